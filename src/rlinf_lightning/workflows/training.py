"""TrainStage: a stage that trains a policy with a train engine whose ranks are its group's replicas.

What every learning stage shares, whatever its loss: building the engine named by
``train_strategy`` for the replicas the plan gives it (and refusing placements the engine cannot
train on, before anything starts), handing its weights to sync targets, and checkpointing (full
state on replica 0, or ``torch.distributed.checkpoint`` shards for a sharded engine). Subclasses
say what to do with micro-batches (``process``) and when to step (``end_iteration``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from tensordict import TensorDict

from rlinf_lightning.engines.precision import resolve_precision
from rlinf_lightning.engines.train import (
    TRAIN_ENGINES,
    TrainSpec,
    build_train_engine,
    resolve_train_engine,
)
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.policies.module import RLModule


class TrainStage(Stage):
    """Hosts ``policy`` in the train engine and precision ``train`` names."""

    def __init__(self, policy: RLModule, train: TrainSpec | None = None) -> None:
        train = train or TrainSpec()
        self.policy, self.train_strategy, self.precision = policy, train.strategy, train.precision
        self.train_engine_options = dict(train.options)

    def check_placement(self, replicas: int, own_process: bool) -> list[tuple[str, str]]:
        name = resolve_train_engine(self.train_strategy, replicas)
        accepted = sorted(inspect.signature(TRAIN_ENGINES.get(name)).parameters)
        unknown = sorted(set(self.train_engine_options) - set(accepted))
        if unknown:
            return [
                (
                    f"trainer.train_engine_options.{key}",
                    f"train engine {name!r} (on {replicas} replica(s)) takes no option {key!r}; "
                    f"it takes {accepted or 'none'}",
                )
                for key in unknown
            ]
        try:
            engine = build_train_engine(self.train_strategy, replicas, self.train_engine_options)
        except (TypeError, ValueError) as exc:
            return [("trainer.train_engine_options", str(exc))]
        problem = engine.check(replicas, own_process)
        return [problem] if problem else []

    def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.engine = build_train_engine(self.train_strategy, ctx.replicas, self.train_engine_options)
        self.engine.setup(copy.deepcopy(self.policy), ctx, resolve_precision(self.precision, ctx.device))

    def engine_info(self) -> dict[str, Any]:
        """Which engine trains here, in which precision, and this replica's rank among how many."""
        name = resolve_train_engine(self.train_strategy, self.ctx.replicas)
        return {
            "engine": name,
            "precision": self.engine.precision,
            "rank": self.ctx.replica,
            "world_size": self.ctx.replicas,
        }

    def sync_state(self) -> TensorDict:
        return TensorDict(dict(self.engine.named_weights()), batch_size=[])

    def onload(self) -> None:
        self.engine.onload()

    def offload(self) -> None:
        self.engine.offload()

    def teardown(self) -> None:
        self.engine.shutdown()

    @property
    def sharded(self) -> bool:
        """Whether the engine checkpoints as ``torch.distributed.checkpoint`` shards."""
        return hasattr(self.engine, "save_sharded")

    def state_dict(self) -> dict[str, Any]:
        """The full state on replica 0 (the others return ``{}``, or join the gather if sharded)."""
        if self.sharded:  # full weights for export (a collective); the optimizer lives in the shards
            weights = dict(self.engine.named_weights())
            return {"model": weights, "optimizer": None} if self.ctx.replica == 0 else {}
        return self.engine.state_dict() if self.ctx.replica == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def save_sharded(self, path: str) -> bool:
        """Write the engine's shards under ``path``; False when the engine is not sharded."""
        if not self.sharded:
            return False
        self.engine.save_sharded(path)
        return True

    def load_sharded(self, path: str) -> None:
        if not self.sharded:
            raise ValueError(
                f"checkpoint {path} holds sharded train state; resume it with trainer.train_strategy "
                "fsdp (any number of devices)"
            )
        self.engine.load_sharded(path)
