"""Hybrid: stages grouped onto slots by an explicit placement (RLinf's syntax), or split where
stage costs balance; groups on different slots pipeline micro-batches between them."""

from __future__ import annotations

from typing import Any

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.placement import parse_placement, placement_text
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import Resources, Strategy


class HybridStrategy(Strategy):
    """Stages placed on groups of slots.

    With ``placement`` (e.g. ``"rollout: 0-1, reward,advantage: 0-1, inference,actor: 2-3"``, see
    ``flow.placement``), stages named with the same slots form one group, data-parallel over those
    slots. Groups may overlap (RLinf's ``"actor: 0-1, env: 0, rollout: 1"``): the workers on a
    shared slot take turns on it (``flow.sharing``). Without a placement, the stages are split in
    data order into two halves of the slots where the ``costs`` of the two sides balance. Groups
    interleave their stages, so micro-batches stream.

    Args:
        placement: stages per slots, in RLinf's syntax (a string or a mapping).
        micro_batches: micro-batches per iteration when ``trainer.micro_batch_size`` is unset.
        costs: relative cost per stage name, for the split without a placement (default: each
            stage's ``cost_hint``).
        slots_per_replica: slots per replica of the group hosting a stage (tensor-parallel
            rollout engines), e.g. ``{rollout: 2}``; default 1.
        offload: whether groups that share slots offload their state after each turn on them
            (context switching), so one at a time holds the device's memory. Default: on GPUs,
            not on CPU (there the host memory is the device, and a spill file only costs time).
    """

    name = "hybrid"

    def __init__(
        self,
        placement: str | dict[str, Any] | None = None,
        micro_batches: int = 4,
        costs: dict[str, float] | None = None,
        slots_per_replica: dict[str, int] | None = None,
        offload: bool | None = None,
    ) -> None:
        self.placement = placement
        self.micro_batches = micro_batches
        self.costs = dict(costs or {})
        self.slots_per_replica = dict(slots_per_replica or {})
        self.offload = offload

    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        if self.placement is not None:
            parts = parse_placement(self.placement, len(resources.slots), workflow.stages)
            notes = f"placement {placement_text(self.placement)!r}"
        else:
            parts, notes = self._balanced(workflow, resources), "cost-balanced split"
        order = workflow.order
        offload = resources.accelerator != "cpu" if self.offload is None else self.offload
        groups = []
        for stages, slots in parts:
            stages = sorted(stages, key=order.index)
            per = max((self.slots_per_replica.get(s, 1) for s in stages), default=1)
            schedule = "interleaved" if len(parts) > 1 else "sequential"
            shares = any(set(slots) & set(other) for _, other in parts if other is not slots)
            groups.append(self.group(stages[0], stages, slots, resources, schedule, per, offload and shares))
        mb = batch.micro_batch_for(self.micro_batches if len(groups) > 1 else 1)
        return self.make_plan(workflow, resources, groups, mb, notes + ", pipelined by micro-batch")

    def _balanced(self, workflow: Workflow, resources: Resources) -> list[tuple[list[str], list[int]]]:
        slots = resources.slots
        if len(slots) < 2:
            raise ValueError(
                "strategy 'hybrid' without a placement splits stages over two slot groups and needs "
                f"trainer.devices >= 2 (got {len(slots)}); use strategy 'collocated' on one slot"
            )
        order = workflow.order
        cost = [self.costs.get(s, workflow.stages[s].cost_hint) for s in order]
        i = min(range(1, len(cost)), key=lambda i: (max(sum(cost[:i]), sum(cost[i:])), -i))
        half = (len(slots) + 1) // 2
        return [(order[:i], slots[:half]), (order[i:], slots[half:])]
