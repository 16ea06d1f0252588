"""Rollout engines (generation) and train engines (how the actor trains)."""

from rlinf_lightning.engines.distributed import DDPTrainEngine, FSDPTrainEngine
from rlinf_lightning.engines.rollout import (
    ROLLOUT_ENGINES,
    Completion,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
)
from rlinf_lightning.engines.train import TRAIN_ENGINES, SingleTrainEngine, TrainEngine

__all__ = [
    "DDPTrainEngine",
    "FSDPTrainEngine",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "Completion",
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingParams",
    "SingleTrainEngine",
    "TrainEngine",
]
