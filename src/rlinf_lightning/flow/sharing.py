"""Overlapping groups: workers of different groups on the same slot take turns on it.

RLinf's default ManiSkill placement is ``actor: 0-7, env: 0-3, rollout: 4-7``: the env and the
rollout pipeline on halves of the GPUs and the actor trains on all of them. Here on two slots that
is ``actor: 0-1, env: 0, rollout: 1``: three groups, four workers, two of them on each slot.

A worker runs its stages in *turns* (:func:`turns_of`: all of them at once when its group is
interleaved, one at a time when sequential). The turns of the workers on one shared slot run in
the workflow's data order, every iteration: on slot 0 the env's turn, then the actor's replica 0,
then the env's turn of the next iteration. A *baton* per shared slot enforces it: a worker waits
for the slot's baton before a turn and hands it to the next worker in that order after it, through
one queue per (slot, worker) that every launcher creates like its other cross-worker queues. A
group that context-switches onloads its stages after taking the baton and offloads them before
handing it on, so only the stage whose turn it is holds the device's memory (the trace shows
those ``onload``/``offload`` spans). Sync state that reaches a worker on a shared slot is applied
at the start of the receiving stage's next turn (or before a call of it), inside its turn.

An order of turns can deadlock: a worker holding a slot waits for input from a worker whose turn
on that slot comes later (two stages of one loop, env and rollout, placed on one slot in two
groups). :func:`sharing_problems` finds such waits before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
    from rlinf_lightning.flow.workflow import Workflow

_Turn = tuple[str, int, int]  # (group name, replica, turn index)


def turns_of(workflow: Workflow, group: WorkerGroup) -> list[list[str]]:
    """The stages a worker of ``group`` runs together: all of them (interleaved), or one at a
    time in data order (sequential) with a loop's head and body on the group as one turn."""
    order = [n for n in workflow.order if n in group.stages]
    if group.schedule == "interleaved":
        return [order]
    turns: list[list[str]] = []
    for n in order:
        lp = workflow.loop_of(n)
        if lp is not None and n == lp.body and lp.head in group.stages:
            continue  # runs in its head's turn
        turns.append([n] + ([lp.body] if lp and n == lp.head and lp.body in group.stages else []))
    return turns


def shared_slots(plan: ExecutionPlan) -> dict[int, list[tuple[WorkerGroup, int]]]:
    """Each slot that more than one worker is on: its workers ``(group, replica)``, in plan order."""
    on: dict[int, list[tuple[WorkerGroup, int]]] = {}
    for g, r in plan.workers:
        for s in g.replica_slots(r):
            on.setdefault(s, []).append((g, r))
    return {s: ws for s, ws in on.items() if len(ws) > 1}


def baton_queue(slot: int, worker: str) -> str:
    """The queue through which ``worker`` receives slot ``slot``'s baton."""
    return f"slot{slot}>{worker}"


def baton_queues(plan: ExecutionPlan, group: str | None = None) -> list[str]:
    """The baton queues of every shared slot (of those ``group``'s workers are on, if given)."""
    return [
        baton_queue(s, g.worker_name(r))
        for s, workers in shared_slots(plan).items()
        if group is None or any(g.name == group for g, _ in workers)
        for g, r in workers
    ]


def slot_order(workflow: Workflow, plan: ExecutionPlan) -> dict[int, list[_Turn]]:
    """Per shared slot, the turns of its workers in the order they take the slot each iteration:
    by the data order of each turn's first stage."""
    order = workflow.order
    out = {}
    for s, workers in shared_slots(plan).items():
        turns = [
            (g.name, r, t, order.index(ts[0]))
            for g, r in workers
            for t, ts in enumerate(turns_of(workflow, g))
        ]
        out[s] = [(g, r, t) for g, r, t, _ in sorted(turns, key=lambda x: x[3])]
    return out


@dataclass(frozen=True)
class SlotTurns:
    """One worker's part in the turns on one shared slot: the queue it takes the baton from, the
    queue it hands the baton to after each of its turns, and whether it holds the baton first."""

    slot: int
    inbox: str
    passes_to: tuple[str, ...]
    first: bool


def slot_turns(workflow: Workflow, plan: ExecutionPlan) -> dict[str, list[SlotTurns]]:
    """Worker name -> its :class:`SlotTurns`, one per shared slot it is on (absent: none)."""
    groups = {g.name: g for g in plan.groups}
    out: dict[str, list[SlotTurns]] = {}
    for s, seq in slot_order(workflow, plan).items():
        workers = [(g, r) for g, r, _ in seq]
        for g, r in dict.fromkeys(workers):
            name = groups[g].worker_name(r)
            after = [workers[(i + 1) % len(workers)] for i, w in enumerate(workers) if w == (g, r)]
            passes = tuple(baton_queue(s, groups[g2].worker_name(r2)) for g2, r2 in after)
            out.setdefault(name, []).append(SlotTurns(s, baton_queue(s, name), passes, workers[0] == (g, r)))
    return out


def sharing_problems(workflow: Workflow, plan: ExecutionPlan) -> list[str]:
    """Turn orders that would deadlock: a turn that waits (for a stage's input, or for its group's
    other replicas in a collective) on a turn that comes after it on a slot they share."""
    order = slot_order(workflow, plan)
    if not order:
        return []
    groups = {g.name: g for g in plan.groups}
    turns = {(g.name, r, t): ts for g, r in plan.workers for t, ts in enumerate(turns_of(workflow, g))}
    where = {stage: [k for k, ts in turns.items() if stage in ts] for stage in workflow.stages}
    waits: dict[_Turn, set[_Turn]] = {k: set() for k in turns}
    for e in workflow.edges:  # within an iteration a stage waits for what feeds it
        if e.kind != "sync" and e.src in where:
            for k in where[e.dst]:
                waits[k] |= {u for u in where[e.src] if u != k}
    for k in turns:  # replicas of a group step together (a train engine's collectives)
        waits[k] |= {(k[0], r, k[2]) for r in range(groups[k[0]].replicas) if r != k[1]}
    problems = []
    for s, seq in order.items():
        pairs = ((a, b) for i, b in enumerate(seq) for a in seq[:i])
        found = next(((a, b, p) for a, b in pairs if (p := _reaches(waits, a, b))), None)
        if found:
            problems.append(_deadlock(s, *found, turns))
    return problems


def _reaches(waits: dict[_Turn, set[_Turn]], a: _Turn, b: _Turn) -> list[_Turn] | None:
    """A chain of waits from turn ``a`` to turn ``b``, if there is one."""
    seen, stack = {a}, [[a]]
    while stack:
        path = stack.pop()
        for n in waits[path[-1]]:
            if n == b:
                return [*path, n]
            if n not in seen:
                seen.add(n)
                stack.append([*path, n])
    return None


def _deadlock(slot: int, earlier: _Turn, later: _Turn, path: list[_Turn], turns: dict) -> str:
    def who(k: _Turn) -> str:
        return f"{', '.join(turns[k])} (group {k[0]!r}, replica {k[1]})"

    return (
        f"slot {slot} is shared, and {who(earlier)} takes its turn on it before {who(later)} but waits "
        f"on it within the iteration ({' -> '.join(turns[k][0] for k in path)}): the turns would "
        "deadlock; place those stages in one group, or on disjoint slots"
    )


def slot_shares(plan: ExecutionPlan) -> dict[str, float]:
    """Worker name -> how many slots it reserves: each of its slots divided among the workers on
    it (``1`` per slot where it is alone), so the reservations of a plan sum to its slots."""
    count: dict[int, int] = {}
    for g, r in plan.workers:
        for s in g.replica_slots(r):
            count[s] = count.get(s, 0) + 1
    return {g.worker_name(r): sum(1 / count[s] for s in g.replica_slots(r)) for g, r in plan.workers}
