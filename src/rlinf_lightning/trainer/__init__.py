"""The trainer: :class:`RLTrainer` holds what every run has and hands the rest to its parts, as
Lightning's trainer does: the plan connector (strategy, resources, workflow and plan, built once),
the logger and callback connectors, and the fit loop (iterations, evaluation, checkpoints)."""

from rlinf_lightning.trainer.trainer import RLTrainer

__all__ = ["RLTrainer"]
