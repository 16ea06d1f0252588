"""Task: what a run trains on. It owns its workflow, its iteration inputs and its evaluation, so
the trainer drives any task the same way (Lightning's ``LightningModule`` owns ``training_step``;
here the task owns the macro flow). A task never sees the trainer: it gets a :class:`RunSpec`
(``workflows.specs``), the few facts of the run it needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.workflows.specs import RunSpec

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime


class Task:
    """Subclass and implement :meth:`batch_shape`, :meth:`build_workflow`, :meth:`inputs` and
    :meth:`evaluate`; construct cheaply (paths, names, numbers).

    Attributes:
        input_keys: the batch keys :meth:`inputs` provides (checked against the stages' ``in_keys``).
        eval_metric: the headline metric of :meth:`evaluate`, reported before and after training.
        headline: logged metric -> short label, shown on the progress line when reported.
    """

    input_keys: tuple[str, ...] = ()
    eval_metric: str = "accuracy"
    headline: dict[str, str] = {}

    def validate_config(self) -> list[tuple[str, str]]:
        """``(key, problem)`` pairs found without loading anything heavy; empty when fine. Keys
        are relative to the task's section (``group_size`` is reported as ``task.group_size``)."""
        return []

    def batch_shape(self, run: RunSpec) -> BatchShape:
        """Samples per iteration, the indivisible unit of a micro-batch, and the requested
        micro-batch size (``run.micro_batch_size``): what strategies cut into micro-batches."""
        raise NotImplementedError

    def build_workflow(self, policy: Any, run: RunSpec) -> Workflow:
        """The stages (built from configuration only) and channels this task trains with; the
        workflow's ``train`` role names the stage that learns and is checkpointed. Raise
        :class:`~rlinf_lightning.errors.ConfigError` naming the keys of settings the workflow
        cannot serve with this policy (reported before any worker starts)."""
        raise NotImplementedError

    def inputs(self, iteration: int, micro_batch_size: int, run: RunSpec) -> list[TensorDict]:
        """Iteration ``iteration``'s input (1-based), cut into micro-batches of about
        ``micro_batch_size`` samples (the plan's granularity). A function of ``iteration`` and
        ``run.seed`` only, so a resumed run continues the same stream."""
        raise NotImplementedError

    def evaluate(self, runtime: Runtime) -> dict[str, float]:
        """Held-out metrics with the current weights, computed on the running workflow (e.g. by
        calling its ``evaluate``-role stage); must include :attr:`eval_metric`. Integer-valued
        extras (e.g. ``problems``) are reported as counts."""
        raise NotImplementedError
