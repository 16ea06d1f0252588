"""Task: what a run trains on. It owns its workflow, its iteration inputs and its evaluation, so
the trainer drives any task the same way (Lightning's ``LightningModule`` owns ``training_step``;
here the task owns the macro flow)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import BatchShape

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime
    from rlinf_lightning.trainer import RLTrainer


class Task:
    """Subclass and implement the three methods; construct cheaply (paths, names, numbers).

    Attributes:
        input_keys: the batch keys :meth:`inputs` provides (checked against the stages' ``in_keys``).
        eval_metric: the headline metric of :meth:`evaluate`, reported before and after training.
    """

    input_keys: tuple[str, ...] = ()
    eval_metric: str = "accuracy"

    def validate_config(self) -> list[tuple[str, str]]:
        """``(key, problem)`` pairs found without loading anything heavy; empty when fine."""
        return []

    def batch_shape(self, trainer: RLTrainer) -> BatchShape:
        """Samples per iteration, the indivisible unit of a micro-batch, and a requested micro-batch
        size: what strategies cut into micro-batches. Default: the trainer's
        ``rollout_batch_size``, ``group_size`` and ``micro_batch_size``."""
        return BatchShape(trainer.rollout_batch_size, trainer.group_size, trainer.micro_batch_size)

    def build_workflow(self, policy: Any, trainer: RLTrainer) -> Workflow:
        """The stages (built from configuration only) and channels this task trains with; the
        workflow's ``train`` role names the stage that learns and is checkpointed."""
        raise NotImplementedError

    def inputs(self, iteration: int, micro_batch_size: int, trainer: RLTrainer) -> list[TensorDict]:
        """Iteration ``iteration``'s input (1-based), cut into micro-batches of about
        ``micro_batch_size`` samples (the plan's granularity). A function of ``iteration`` and the
        trainer's seed only, so a resumed run continues the same stream."""
        raise NotImplementedError

    def evaluate(self, runtime: Runtime) -> dict[str, float]:
        """Held-out metrics with the current weights, computed on the running workflow (e.g. by
        calling its ``evaluate``-role stage); must include :attr:`eval_metric`. Integer-valued
        extras (e.g. ``problems``) are reported as counts."""
        raise NotImplementedError
