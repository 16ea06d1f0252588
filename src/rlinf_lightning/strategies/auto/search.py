"""Search: every placement and granularity worth simulating, ranked by predicted iteration time.

Candidates on the resources' slots:

- one worker in the driver's process (the ``inprocess`` launcher, whatever ``trainer.launcher``
  is): every stage on one slot, or on every slot (on CPU: one torch thread per core). Nothing to
  spawn, so it starts in a fraction of the time worker processes take: on a short run that can
  outweigh a faster plan. Offered on one machine, on CPU or one GPU, when every stage may run in
  the driver's process (``Stage.check_placement``);
- collocated: every stage on every slot, data-parallel replicas, stages time-shared;
  (one slot per replica, the unit a profile measures, as in the splits);
- two-group splits: the stages cut in data order (the first ``i`` stages and the rest), the slots
  cut in two (``k`` and the rest), each group data-parallel over its slots and both pipelined by
  micro-batch. The cut after the first stage with half the slots is ``disaggregated``; every
  other cut is a ``hybrid`` placement, written in RLinf's syntax so it can be pasted back;
- overlapping: the learning stage data-parallel on every slot, the stages before it cut in two
  groups on disjoint slots as in the splits (RLinf's ``actor: 0-7, env: 0-3, rollout: 4-7``), each
  of the learner's replicas taking its turn on its slot after theirs (``flow.sharing``); cuts whose
  turns would deadlock (a loop's two stages apart) are left out;

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
from rlinf_lightning.flow.sharing import sharing_problems
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


PLACEMENTS = (
    "collocated",
    "split",
    "overlap",
)  # the multi-worker kinds: what ``rlinf plan`` ranks for a cluster
KINDS = ("one_worker", *PLACEMENTS)
IN_PROCESS = "inprocess"


def one_worker_allowed(workflow: Workflow, resources: Resources) -> bool:
    """Whether one worker in the driver's process can run the workflow on these resources."""
    if resources.num_nodes > 1 or (resources.accelerator != "cpu" and resources.devices > 1):
        return False
    return not any(st.check_placement(1, False) for st in workflow.stages.values())


def one_worker_plan(workflow: Workflow, resources: Resources, batch: BatchShape, slots: int) -> ExecutionPlan:
    """Every stage on one worker over the first ``slots`` slots, in the driver's process."""
    res = Resources(slots, 1, resources.accelerator, resources.threads(1))
    plan = CollocatedStrategy(replicas=1).plan(workflow, res, batch)
    plan.strategy, plan.launcher = "auto", IN_PROCESS
    plan.notes = f"one worker on {slots} slot(s), in this process"
    return plan


def placements(
    workflow: Workflow, slots: list[int], kinds: tuple[str, ...] = PLACEMENTS
) -> list[tuple[str, str | None]]:
    """``(name, placement)`` pairs of the ``kinds`` asked for: collocated (placement ``None``),
    every two-group split, every overlapping placement."""
    out: list[tuple[str, str | None]] = [("collocated", None)] if "collocated" in kinds else []
    order = workflow.order
    for i in range(1, len(order)):
        for k in range(1, len(slots)):
            first, rest = ",".join(order[:i]), ",".join(order[i:])
            text = f"{first}: {format_slots(slots[:k])}, {rest}: {format_slots(slots[k:])}"
            name = "disaggregated" if i == 1 and k == (len(slots) + 1) // 2 else "hybrid"
            if "split" in kinds:
                out.append((name, text))
            train = workflow.roles.get("train")
            if "overlap" in kinds and order[-1] == train and i < len(order) - 1:
                rest = ",".join(order[i:-1])
                cut = f"{first}: {format_slots(slots[:k])}, {rest}: {format_slots(slots[k:])}"
                out.append(("overlapping", f"{train}: {format_slots(slots)}, {cut}"))
    return out


def candidates(
    workflow: Workflow,
    resources: Resources,
    batch: BatchShape,
    profile: Profile,
    fits: Callable[[ExecutionPlan], bool] | None = None,
    kinds: tuple[str, ...] = PLACEMENTS,
) -> list[Candidate]:
    """Every candidate plan of the placement ``kinds``, simulated and sorted fastest first; the
    one-worker plans only at widths the profile measured."""
    out = []
    for mb in micro_batches(workflow, batch, profile):
        shape = BatchShape(batch.rollout_batch_size, batch.group_size, mb)
        plans = []
        if "one_worker" in kinds and one_worker_allowed(workflow, resources):
            n = len(resources.slots)
            for width in [1] + ([n] if n > 1 and str(n) in profile.speedup else []):
                name = f"one worker ({width} slot(s), in this process)"
                plans.append((name, None, one_worker_plan(workflow, resources, shape, width)))
        for name, placement in placements(workflow, resources.slots, kinds):
            if placement is None:
                plan = CollocatedStrategy().plan(workflow, resources, shape)
            else:
                plan = HybridStrategy(placement=placement).plan(workflow, resources, shape)
                if sharing_problems(workflow, plan):
                    continue
            plan.strategy = "auto"
            plans.append((name, placement, plan))
        for name, placement, plan in plans:
            if fits is None or fits(plan):
                c = Candidate(name, plan, placement=placement)
                c.predicted_s = simulate(workflow, plan, profile, batch.rollout_batch_size)
                out.append(c)
    return sorted(out, key=lambda c: c.predicted_s)


def placement_syntax(c: Candidate) -> str:
    """The candidate's placement as the hybrid strategy takes it (collocated: every stage on all)."""
    return c.placement or f"{','.join(c.plan.groups[0].stages)}: all"


def describe(c: Candidate) -> str:
    """One line: name, placement, granularity."""
    where = f" [{c.placement}]" if c.placement else ""
    if c.name == "collocated":
        where = f" ({c.plan.groups[0].replicas} replicas)"
    return f"{c.name}{where}, micro-batch {c.micro_batch}"
