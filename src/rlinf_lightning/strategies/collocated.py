"""Collocated: every stage on the same slots, one stage at a time, context-switched."""

from __future__ import annotations

from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import Resources, Strategy


class CollocatedStrategy(Strategy):
    """All stages time-share all slots; each runs to the end of the iteration before the next.

    Args:
        offload: call each stage's ``offload`` after its turn and ``onload`` before it, so one
            stage at a time holds device memory (weights, optimizer state, KV cache).
    """

    name = "collocated"

    def __init__(self, offload: bool = False) -> None:
        self.offload = offload

    def plan(self, workflow: Workflow, resources: Resources, micro_batch_size: int) -> ExecutionPlan:
        worker = WorkerGroupSpec(
            name="all",
            stages=workflow.order,
            slots=resources.slots,
            schedule="sequential",
            context_switch=self.offload,
        )
        mbs = {workflow.input_edge(s).channel: micro_batch_size for s in workflow.order}
        return ExecutionPlan(self.name, [worker], mbs, notes="time-shared, one stage at a time")
