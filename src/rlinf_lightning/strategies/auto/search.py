"""Search: every placement and granularity worth simulating, ranked by predicted iteration time.

Candidates on the resources' slots (one slot per replica, the unit a profile measures):

- collocated: every stage on every slot, data-parallel replicas, stages time-shared;
- two-group splits: the stages cut in data order (the first ``i`` stages and the rest), the slots
  cut in two (``k`` and the rest), each group data-parallel over its slots and both pipelined by
  micro-batch. The cut after the first stage with half the slots is ``disaggregated``; every
  other cut is a ``hybrid`` placement, written in RLinf's syntax so it can be pasted back;

each at every granularity: micro-batches of whole groups (``batch.group_size``) that divide the
iteration's batch (for a sticky first stage, e.g. an env stage owning its envs, only the sizes the
profile measured: its state is cut at set-up and a size it never ran at is a guess). Plans the
``fits`` callback refuses (memory) are dropped before simulating.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.plan import ExecutionPlan, format_slots
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.auto.profile import Profile
from rlinf_lightning.strategies.auto.simulate import simulate
from rlinf_lightning.strategies.base import Resources
from rlinf_lightning.strategies.collocated import CollocatedStrategy
from rlinf_lightning.strategies.hybrid import HybridStrategy


@dataclass
class Candidate:
    """A plan and its predicted seconds per iteration; ``placement`` is the hybrid syntax
    (``None`` for collocated)."""

    name: str
    plan: ExecutionPlan
    predicted_s: float = float("nan")
    placement: str | None = None

    @property
    def micro_batch(self) -> int:
        return next(iter(self.plan.micro_batch_size.values()))


def micro_batches(workflow: Workflow, batch: BatchShape, profile: Profile) -> list[int]:
    """The granularities to try (see the module docstring)."""
    unit, total = batch.group_size, batch.rollout_batch_size
    sizes = [n for n in range(unit, total + 1, unit) if total % n == 0]
    first = workflow.order[0]
    if workflow.stages[first].sticky:
        measured = set(profile.stages[first].sizes) if first in profile.stages else set()
        sizes = [n for n in sizes if n in measured] or sizes[-1:]
    return sizes


KINDS = ("collocated", "split")


def placements(
    workflow: Workflow, slots: list[int], kinds: tuple[str, ...] = KINDS
) -> list[tuple[str, str | None]]:
    """``(name, placement)`` pairs of the ``kinds`` asked for: collocated (placement ``None``),
    every two-group split."""
    out: list[tuple[str, str | None]] = [("collocated", None)] if "collocated" in kinds else []
    if "split" not in kinds:
        return out
    order = workflow.order
    for i in range(1, len(order)):
        for k in range(1, len(slots)):
            first, rest = ",".join(order[:i]), ",".join(order[i:])
            text = f"{first}: {format_slots(slots[:k])}, {rest}: {format_slots(slots[k:])}"
            name = "disaggregated" if i == 1 and k == (len(slots) + 1) // 2 else "hybrid"
            out.append((name, text))
    return out


def candidates(
    workflow: Workflow,
    resources: Resources,
    batch: BatchShape,
    profile: Profile,
    fits: Callable[[ExecutionPlan], bool] | None = None,
    kinds: tuple[str, ...] = KINDS,
) -> list[Candidate]:
    """Every candidate plan of the placement ``kinds``, simulated and sorted fastest first."""
    out = []
    for name, placement in placements(workflow, resources.slots, kinds):
        for mb in micro_batches(workflow, batch, profile):
            shape = BatchShape(batch.rollout_batch_size, batch.group_size, mb)
            if placement is None:
                plan = CollocatedStrategy().plan(workflow, resources, shape)
            else:
                plan = HybridStrategy(placement=placement).plan(workflow, resources, shape)
            plan.strategy = "auto"
            if fits is not None and not fits(plan):
                continue
            c = Candidate(name, plan, placement=placement)
            c.predicted_s = simulate(workflow, plan, profile, batch.rollout_batch_size)
            out.append(c)
    return sorted(out, key=lambda c: c.predicted_s)


def placement_syntax(c: Candidate) -> str:
    """The candidate's placement as the hybrid strategy takes it (collocated: every stage on all)."""
    return c.placement or f"{','.join(c.plan.groups[0].stages)}: all"


def describe(c: Candidate) -> str:
    """One line: name, placement, granularity."""
    where = f" [{c.placement}]" if c.placement else f" ({c.plan.groups[0].replicas} replicas)"
    return f"{c.name}{where}, micro-batch {c.micro_batch}"
