"""Collocated: every stage on the same slots, one stage at a time."""

from __future__ import annotations

from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import BatchShape, Resources, Strategy


class CollocatedStrategy(Strategy):
    """All stages time-share all slots; each runs to the end of the iteration before the next.

    On CPU the single worker uses every slot's threads (intra-op parallelism over all cores).

    Args:
        offload: context switching: call each stage's ``offload`` after its turn and ``onload``
            before it, so one stage at a time holds device memory (weights, optimizer state, cache).
    """

    name = "collocated"

    def __init__(self, offload: bool = False) -> None:
        self.offload = offload

    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        worker = WorkerGroupSpec(
            name="all",
            stages=workflow.order,
            slots=resources.slots,
            schedule="sequential",
            context_switch=self.offload,
            num_threads=resources.threads(len(resources.slots)),
        )
        mb = batch.micro_batch_size or batch.rollout_batch_size
        mbs = {workflow.input_edge(s).channel: mb for s in workflow.order}
        return ExecutionPlan(self.name, [worker], mbs, notes="time-shared, one stage at a time")
