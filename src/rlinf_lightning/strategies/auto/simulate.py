"""Simulate one iteration of a plan from a profile: predicted seconds, not a sum of stage times.

The simulator runs the plan's schedule the way the workers do (``flow.worker``), with the real
wiring (``flow.wiring.wire``) and each call's cost from the :class:`~.profile.Profile`:

- the input's micro-batches wait in the source queue; a replica of a group pulls the next one
  when it is free (shared queues), a sticky stage's replica gets the keys it owns;
- a ``sequential`` replica runs its stages turn by turn, each to the end of the iteration (a
  loop's head and body in one turn); an ``interleaved`` one serves whichever hosted stage has a
  message waiting, downstream first, so groups on different slots overlap;
- a loop sends each micro-batch ``turns`` times round head -> body -> head;
- a stage's end of iteration follows its last input; the learning stage's replicas step together
  (a collective: each waits for the last to arrive);
- a message between workers costs ``profile.message_s``; sync state costs its two measured ends
  (plus a message when it crosses workers); a worker's iteration ends after it applied its syncs;
- workers of overlapping groups on one slot take turns on it (``flow.sharing``): a turn starts
  after the turn before it on each shared slot ended (context switches are not costed).

The iteration time is the last worker's end plus ``profile.overhead_s``.

A workflow whose sync edges lag (``max_staleness`` k > 0) lets iterations overlap: a worker starts
iteration ``j + 1`` the moment it ends ``j``, having applied version ``j - k`` of its sync state
(not ``j``), while at most ``Workflow.in_flight`` iterations are outstanding (iteration ``j`` is
queued once the driver collected ``j - in_flight``). So a rollout group on its own slots rolls out
the next batch while the learner trains on this one, and one worker gains nothing. The simulator
then runs ``LAGGED_ITERATIONS`` iterations back to back, each worker's ``overhead_s`` charged
after its own iteration, and returns the steady period: the mean gap between the driver's
collects over the second half, or, once three gaps in a row are equal, that gap (a steady state
repeats; stopping there halves the cost of ranking lagged plans).

A replica spanning several slots (on CPU, a worker with several torch threads) runs each stage
``profile.factor(stage, width)`` times faster than one slot: how a stage speeds up over more
slots (the threads' share of its work, their contention) is not something one slot shows, so it
is the measured speed-up of that width (auto measures its one-worker width), and a plan with a
width never measured is refused rather than predicted with one slot's costs. A stage with a
measured cost curve over device counts costs ``profile.replicas_factor(stage, replicas)`` times
more per call (and per end of iteration) in a group of that many data-parallel replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.sharing import slot_order, turns_of
from rlinf_lightning.flow.wiring import Link, wire
from rlinf_lightning.flow.workflow import SOURCE, Workflow
from rlinf_lightning.strategies.auto.profile import Profile

#: iterations simulated back to back for a workflow with lagged syncs (its transient is about
#: ``max_staleness + 2`` iterations; the period is taken over the second half), unless
#: ``STEADY_GAPS`` gaps between collects in a row are equal first (the period is then that gap)
LAGGED_ITERATIONS = 12
STEADY_GAPS = 3


@dataclass
class _Msg:
    key: int
    turn: int
    origin: int
    ready: float
    crossed: bool


def _ready(m: _Msg) -> float:
    return m.ready


@dataclass
class _Worker:
    group: WorkerGroup
    replica: int
    turns: list[list[str]]
    free_at: float = 0.0
    turn: int = 0
    blocked: bool = False  # waiting in a collective step
    finished_at: float | None = None  # all turns done (syncs still to apply)
    end: float | None = None  # the iteration's end on this worker
    done: set[str] = field(default_factory=set)


class _Sim:
    def __init__(self, workflow: Workflow, plan: ExecutionPlan, profile: Profile, batch: int) -> None:
        measured = [1, *sorted(int(w) for w in profile.speedup)]
        if wide := [g.name for g in plan.groups if g.slots_per_replica not in measured]:
            raise ValueError(
                f"cannot simulate plan {plan.strategy!r}: group(s) {wide} have replicas spanning "
                f"several slots, and the profile measured replicas of {measured} slot(s) only"
            )
        self.wf, self.plan, self.profile = workflow, plan, profile
        self.links: dict[str, Link] = wire(workflow, plan)
        self.inputs: dict[str, list[Link]] = {st: [] for st in workflow.stages}  # the links each reads
        for link in self.links.values():
            if link.edge.kind in ("stream", "loop", "return"):
                self.inputs[link.edge.dst].append(link)
        self.mb = plan.micro_batch_size[workflow.source_edge.channel]
        # what each step asks of the workflow, looked up once (a search simulates many plans)
        self.loop = {st: workflow.loop_of(st) for st in workflow.stages}
        self.out = {st: workflow.output_edge(st) for st in workflow.stages}
        self.syncs = workflow.edges_of("sync")
        self.costs: dict[tuple[str, str], float] = {}  # (stage, group) -> seconds per call
        self.workers = [_Worker(g, r, turns_of(workflow, g)) for g, r in plan.workers]
        self.by_slot = {(w.group.name, w.replica): w for w in self.workers}
        self.turn_before: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {}  # on shared slots
        self.slot_turns = list(slot_order(workflow, plan).values())
        for seq in self.slot_turns:
            for prev, turn in zip(seq, seq[1:]):
                self.turn_before.setdefault(turn, []).append(prev)
        self.turn_end: dict[tuple[str, int, int], float] = {}
        self.train = workflow.roles.get("train")
        self.n_msgs = math.ceil(batch / self.mb)
        # (dst stage, replica) -> version -> when that version of its sync state arrives
        self.versions: dict[tuple[str, int], dict[int, float]] = {}
        self._begin(1, 0.0)

    def _begin(self, iteration: int, queued_at: float) -> None:
        """Iteration ``iteration``'s input, queued at ``queued_at``; each worker starts it once it
        ended the one before (its ``free_at``)."""
        self.iteration = iteration
        # a shared slot's first turn follows its last turn of the iteration before
        ended = self.turn_end
        self.slot_since = {seq[0]: ended[seq[-1]] for seq in self.slot_turns if seq[-1] in ended}
        self.turn_end = {}
        self.queues: dict[tuple[str, int | None], list[_Msg]] = {}
        self.done_at: dict[tuple[str, int], float] = {}  # (stage, replica) -> end of its iteration
        self.in_flight: dict[tuple[str, int], int] = {}
        self.arrived: dict[str, dict[int, float]] = {}  # collective step: replica -> arrival
        self.calls: dict[tuple[str, int], int] = {}  # (stage, replica) -> messages it processed
        for w in self.workers:
            w.free_at = max(w.free_at, queued_at)
            w.turn, w.done, w.blocked, w.finished_at, w.end = 0, set(), False, None, None
        src = self.links[self.wf.source_edge.channel]
        for k in range(self.n_msgs):
            self._put(src, _Msg(k, 0, 0, queued_at, False), replica=0)

    # -- queues ----------------------------------------------------------------------------------
    def _queue(self, link: Link, replica: int | None) -> list[_Msg]:
        key = (link.edge.channel, None if link.mode == "shared" else replica)
        return self.queues.setdefault(key, [])

    def _put(self, link: Link, msg: _Msg, replica: int, target: int | None = None) -> None:
        if link.mode == "local":
            self._queue(link, replica).append(msg)
            return
        msg.crossed = link.edge.src != SOURCE
        if link.mode == "shared":
            self._queue(link, None).append(msg)
            return
        if target is None:
            target = msg.origin if link.edge.kind == "return" else msg.key
        self._queue(link, target % link.consumers).append(msg)

    def _inputs_end(self, stage: str, replica: int) -> float | None:
        """When the last producer of ``stage``'s counted inputs on ``replica`` ended (None: not yet)."""
        t = 0.0
        for link in self.inputs[stage]:
            e = link.edge
            if e.kind == "return" or e.src == SOURCE:
                continue
            producers = [replica] if link.mode == "local" else range(link.producers)
            for r in producers:
                end = self.done_at.get((e.src, r))
                if end is None:
                    return None
                t = max(t, end)
        return t

    # -- one worker's next step -------------------------------------------------------------------
    def _slot_free(self, w: _Worker) -> float | None:
        """When the worker's current turn may start on its shared slots: once the turn before it
        on each has ended (``None``: one has not yet)."""
        t = self.slot_since.get((w.group.name, w.replica, w.turn), 0.0)
        for prev in self.turn_before.get((w.group.name, w.replica, w.turn), ()):
            end = self.turn_end.get(prev)
            if end is None:
                return None
            t = max(t, end)
        return t

    def _next(self, w: _Worker) -> tuple[float, str, str, tuple | None] | None:
        """(time, stage, action, queue item) of the worker's next step, or None if it waits on
        something that has not happened yet. Its turn's stages are tried last first (the later
        stage drains the pipeline), each's queued inputs before its end of iteration."""
        if w.turn >= len(w.turns) or (free := self._slot_free(w)) is None:
            return None
        w.free_at = max(w.free_at, free)
        best = None
        for s in reversed(w.turns[w.turn]):
            if s in w.done:
                continue
            pending = False
            for link in self.inputs[s]:
                q = self._queue(link, w.replica)
                if q:
                    pending = True
                    m = min(q, key=_ready)
                    t = max(w.free_at, m.ready)
                    if best is None or t < best[0]:
                        best = (t, s, "process", (link, m))
            if pending or self.in_flight.get((s, w.replica), 0):
                continue
            end = self._inputs_end(s, w.replica)
            if end is not None:
                t = max(w.free_at, end)
                if best is None or t < best[0]:
                    best = (t, s, "end", None)
        return best

    def _cost(self, stage: str, w: _Worker) -> float:
        key = (stage, w.group.name)
        if key not in self.costs:
            c, g = self.profile.stages.get(stage), w.group
            self.costs[key] = (
                0.0
                if c is None
                else max(c.call_s(self.mb), 0.0)
                * self.profile.replicas_factor(stage, g.replicas)
                / self.profile.factor(stage, g.slots_per_replica)
            )
        return self.costs[key]

    def _process(self, w: _Worker, t: float, stage: str, link: Link, m: _Msg) -> None:
        self._queue(link, w.replica).remove(m)
        self.calls[(stage, w.replica)] = self.calls.get((stage, w.replica), 0) + 1
        t_end = t + self._cost(stage, w) + (self.profile.message_s if m.crossed else 0.0)
        w.free_at = t_end
        lp = self.loop[stage]
        key = (stage, w.replica)
        if lp is not None and lp.head == stage:
            turn = 1 if link.edge.kind == "stream" else m.turn + 1
            if link.edge.kind == "stream":
                self.in_flight[key] = self.in_flight.get(key, 0) + 1
            if turn <= lp.turns:
                out = self.links[f"{lp.head}->{lp.body}"]
                self._put(out, _Msg(m.key, turn, w.replica, t_end, False), w.replica)
                return
            self.in_flight[key] -= 1
        elif lp is not None:  # the body answers the head replica that asked
            back = self.links[f"{lp.body}->{lp.head}"]
            self._put(back, _Msg(m.key, m.turn, m.origin, t_end, False), w.replica)
            return
        out_edge = self.out[stage]
        if out_edge is not None:
            self._put(self.links[out_edge.channel], _Msg(m.key, 0, w.replica, t_end, False), w.replica)

    def _finish_stage(self, w: _Worker, stage: str, t_end: float) -> None:
        w.done.add(stage)
        w.free_at = t_end
        self.done_at[(stage, w.replica)] = t_end
        for e in self.syncs:
            if e.src != stage:
                continue
            t_state = t_end + self.profile.sync_s.get(stage, 0.0)
            w.free_at = t_state
            link = self.links[e.channel]
            for target in link.sync_targets(w.replica):
                cross = 0.0 if link.mode == "local" else self.profile.message_s
                self.versions.setdefault((e.dst, target), {})[self.iteration] = t_state + cross
        if all(s in w.done for s in w.turns[w.turn]):
            self.turn_end[(w.group.name, w.replica, w.turn)] = w.free_at
            w.turn += 1
            if w.turn >= len(w.turns):
                w.finished_at = w.free_at

    def _end(self, w: _Worker, t: float, stage: str) -> None:
        cost = self.profile.stages[stage].end_s if stage in self.profile.stages else 0.0
        cost *= self.profile.replicas_factor(stage, w.group.replicas)
        cost /= self.profile.factor(stage, w.group.slots_per_replica)
        if self.wf.stages[stage].end_per_sample:  # measured on one worker holding every sample
            cost *= self.calls.get((stage, w.replica), 0) / self.n_msgs
        if stage == self.train and w.group.replicas > 1:  # a collective step
            arrived = self.arrived.setdefault(stage, {})
            arrived[w.replica] = t
            w.blocked = True
            if len(arrived) < w.group.replicas:
                return
            t_end = max(arrived.values()) + cost
            for r in arrived:
                peer = self.by_slot[(w.group.name, r)]
                peer.blocked = False
                self._finish_stage(peer, stage, t_end)
            return
        self._finish_stage(w, stage, t + cost)

    def _apply_syncs(self, w: _Worker) -> bool:
        """End the worker's iteration once the sync state its stages are due arrived: version
        ``iteration - staleness`` of each edge (none before the first)."""
        t = w.finished_at or 0.0
        for e in self.syncs:
            due = self.iteration - e.staleness
            if e.dst in w.group.stages and due >= 1:
                ready = self.versions.get((e.dst, w.replica), {}).get(due)
                if ready is None:
                    return False
                t = max(t, ready) + self.profile.sync_s.get(e.dst, 0.0)
        w.end = t
        return True

    def run(self) -> float:
        """Seconds per iteration: one iteration's, or with lagged syncs the steady period."""
        if not self.wf.max_staleness:
            return self._run_iteration() + self.profile.overhead_s
        collected: list[float] = []
        for j in range(1, LAGGED_ITERATIONS + 1):
            if j > 1:
                ahead = j - self.wf.in_flight
                self._begin(j, collected[ahead - 1] if ahead >= 1 else 0.0)
            self._run_iteration()
            for w in self.workers:
                w.free_at = w.end = (w.end or 0.0) + self.profile.overhead_s
            collected.append(max(collected[-1:] + [w.end for w in self.workers]))
            if j < self.wf.max_staleness + 2 + STEADY_GAPS:  # still in the transient
                continue
            gaps = [b - a for a, b in zip(collected[-STEADY_GAPS - 1 :], collected[-STEADY_GAPS:])]
            if min(gaps) > 0 and max(gaps) - min(gaps) <= 1e-9 * max(gaps):
                return gaps[-1]  # a steady period of one iteration: later ones repeat it
        half = LAGGED_ITERATIONS // 2
        return (collected[-1] - collected[half - 1]) / (LAGGED_ITERATIONS - half)

    def _run_iteration(self) -> float:
        """Run the current iteration to its end on every worker; returns the last worker's end."""
        while True:
            steps = []
            for w in self.workers:
                if w.end is not None or w.blocked:
                    continue
                if w.finished_at is not None:
                    if self._apply_syncs(w):
                        steps.append(None)  # progress made
                    continue
                nxt = self._next(w)
                if nxt is not None:
                    steps.append((nxt[0], id(w), w, nxt))
            if all(w.end is not None for w in self.workers):
                return max(w.end for w in self.workers)
            real = [s for s in steps if s is not None]
            if not real:
                if None in steps:
                    continue
                stuck = [w.group.worker_name(w.replica) for w in self.workers if w.end is None]
                raise RuntimeError(f"simulated plan {self.plan.strategy!r} cannot finish: {stuck} wait")
            t, _, w, (_, stage, action, item) = min(real, key=lambda s: (s[0], s[1]))
            if action == "process":
                self._process(w, t, stage, *item)
            else:
                self._end(w, t, stage)


def simulate(workflow: Workflow, plan: ExecutionPlan, profile: Profile, batch: int) -> float:
    """Predicted seconds of one iteration of ``batch`` samples under ``plan`` (``ValueError`` for
    a plan the simulator does not model: see the module docstring)."""
    return _Sim(workflow, plan, profile, batch).run()
