"""Disaggregated: the first stage (generation) and the rest (training) on disjoint slots, pipelined."""

from __future__ import annotations

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import Resources, Strategy


class DisaggregatedStrategy(Strategy):
    """The first stage (rollout, or an env) on the first ``generation_slots`` slots, every other
    stage on the rest; micro-batches of whole groups stream between them (elastic pipelining) and
    each group is data-parallel over its slots.

    Args:
        micro_batches: micro-batches per iteration when ``trainer.micro_batch_size`` is unset.
        generation_slots: slots of the generation group (default: half, rounded up).
    """

    name = "disaggregated"

    def __init__(self, micro_batches: int = 4, generation_slots: int | None = None) -> None:
        self.micro_batches, self.generation_slots = micro_batches, generation_slots

    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        slots = resources.slots
        k = self.generation_slots or (len(slots) + 1) // 2
        if len(slots) < 2 or not 0 < k < len(slots):
            raise ValueError(
                f"strategy {self.name!r} places stages on separate slots and needs trainer.devices >= 2 "
                f"(got {len(slots)} slot(s), generation_slots={k}); use strategy 'collocated' on one slot"
            )
        order = workflow.order
        groups = [
            self.group("gen", order[:1], slots[:k], resources, "interleaved"),
            self.group("train", order[1:], slots[k:], resources, "interleaved"),
        ]
        notes = f"{order[0]} | rest, pipelined by micro-batch"
        return self.make_plan(workflow, resources, groups, batch.micro_batch_for(self.micro_batches), notes)
