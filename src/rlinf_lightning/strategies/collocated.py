"""Collocated: every stage on every slot, time-shared, data-parallel over replicas."""

from __future__ import annotations

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import Resources, Strategy


class CollocatedStrategy(Strategy):
    """One group over all slots hosting every stage; each replica runs the stages one after
    another, each to the end of the iteration, on its share of the micro-batches.

    Args:
        offload: context switching: call each stage's ``offload`` after its turn and ``onload``
            before it, so one stage at a time holds device memory (weights, optimizer state, cache).
        replicas: data-parallel replicas (default: one per slot). ``1`` is one worker spanning every
            slot (on CPU: one process whose torch threads use every core).
    """

    name = "collocated"

    def __init__(self, offload: bool = False, replicas: int | None = None) -> None:
        self.offload, self.replicas = offload, replicas

    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        slots = resources.slots
        replicas = self.replicas or len(slots)
        if replicas < 1 or len(slots) % replicas:
            raise ValueError(
                f"strategy 'collocated': replicas={replicas} must divide the {len(slots)} slots "
                "(trainer.devices x trainer.num_nodes)"
            )
        per = len(slots) // replicas
        group = self.group("all", workflow.order, slots, resources, "sequential", per, self.offload)
        what = "one worker" if replicas == 1 else f"data-parallel over {replicas} replicas"
        return self.make_plan(
            workflow, resources, [group], batch.micro_batch_for(replicas), f"{what}, stages time-shared"
        )
