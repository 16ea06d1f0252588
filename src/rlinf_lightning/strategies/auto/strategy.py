"""Auto: measure the run's own stages, simulate every candidate plan, run the best, keep re-tuning.

RLinf's auto placement is an offline tool (stage times measured by hand, typed into YAML, a
script run, its placement pasted back). Here the first iterations (three with several slots,
two where the first stage runs at one granularity) are the measurement:

1. They run under the profiling plan: one worker on one slot in the driver's process (nothing
   to spawn, so a short run pays no process start-up for the measurement; where one in-process
   worker is not a candidate, collocated with one replica per slot on the trainer's launcher).
   Each stage sits on one slot, as every candidate's groups are, at two granularities:
   iteration 1 at two micro-batches per replica of the collocated plan (its first call per stage
   is set-up and is dropped), iteration 2 at one. With several slots, the next iteration runs the
   same worker on every slot (on CPU one thread per core), at the granularity it runs alone, to
   measure each stage's speed-up over them: iteration 3, or 2 for a sticky first stage (one
   granularity: iteration 1 is its only one-slot iteration, and the wide one also gives the
   end-of-iteration costs its set-up hid). Should that make the worker on fewer slots the
   choice, it runs one more iteration on all and is timed again first: its first there paid
   the new width's set-up, and the narrower plan, once taken, is the one re-tuning would check
   (a single such iteration once kept auto on one of two cores for a whole run).
   They train like every other iteration: nothing is thrown away, and nothing else runs beside
   them (on CPU, workers starting in the background would take the very cores they measure).
2. Each stage's time per call is fitted as ``a + b x micro_batch`` (``auto.profile``); the part
   of an iteration no stage call covers is calibrated so the profiling plan's simulation matches
   its measured iteration 2 (for a sticky first stage, the part of iteration 1 no span covers:
   one thread's, where the wide iteration uses every core).
3. Every candidate (``auto.search``: one in-process worker on one or every slot, collocated,
   every two-group split of stages and slots, every granularity; minus what memory refuses) is
   simulated (``auto.simulate``); the five fastest are printed. The plan taken is the one with
   the least predicted whole fit: the start-up of its workers (none for the workers already
   running; a granularity change is free) plus the remaining iterations at its predicted
   seconds. Start-up is measured on this run (the in-process set-up; worker processes once any
   started), and until then estimated (``launch_estimate``). So a short run stays in-process
   when a faster plan would not repay its launch, and a long run moves. One line says why.
   Where the launcher can, the chosen plan's workers start in the background (``ahead``) while
   the profiling worker trains on one slot at its best granularity (the others' cores go to the
   start-up); the switch follows the first iteration that ends with them up.
4. From then on each iteration logs ``auto/predicted_s`` and ``auto/measured_s``. When they differ
   by more than ``retune_threshold`` for ``retune_patience`` iterations in a row, the stages are
   re-fitted from the recent iterations (first keeping each stage's per-sample slope, the only
   guess one granularity allows; then, once the new granularity has run, from both) and the best
   plan is taken again, with the reason printed. The first iteration on new workers is not
   compared (its first calls pay their set-up), nor those run while workers start ahead.

The profile is saved as JSON (``save_profile``) and can be given back (``profile``) to skip the
measurement, or ranked for a larger cluster with ``rlinf plan``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.memory import memory_problems
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.auto.launch import launch_estimate, process_age_s
from rlinf_lightning.strategies.auto.profile import Profile
from rlinf_lightning.strategies.auto.search import (
    IN_PROCESS,
    KINDS,
    Candidate,
    candidates,
    describe,
    one_worker_allowed,
    one_worker_plan,
)
from rlinf_lightning.strategies.auto.simulate import simulate
from rlinf_lightning.strategies.base import Replan, Resources, RunInfo, Strategy
from rlinf_lightning.strategies.collocated import CollocatedStrategy

PROFILING_ITERATIONS = 2  # on one slot

log = logging.getLogger(__name__)


@dataclass
class _Seen:
    iteration: int
    micro_batch: int
    seconds: float
    spans: list[Span]


class AutoStrategy(Strategy):
    """Chooses and re-tunes the plan itself (see the module docstring).

    Args:
        profile: a saved profile (JSON) to plan from instead of measuring this run's first
            iterations.
        save_profile: where to write the profile (default ``<default_root_dir>/profile.json``;
            ``""``: not written).
        retune_threshold: relative gap between measured and predicted seconds per iteration that
            counts as drift.
        retune_patience: iterations in a row with drift before re-tuning.
        top: how many ranked plans to print.
        launch_s: seconds that starting worker processes costs, used until some start on this
            run (then measured); default: estimated (:func:`launch_estimate`). Give it where this
            process's age is no measure of its start-up, e.g. in a notebook.
        placements: the kinds of placement to choose from: ``one_worker`` (every stage on one
            worker in this process, on one or every slot), ``collocated`` (every stage on every
            slot), ``split`` (two groups on disjoint slots, pipelined) and ``overlap`` (the
            learning stage on every slot, taking turns with two such groups).
    """

    name = "auto"

    def __init__(
        self,
        profile: str | None = None,
        save_profile: str | None = None,
        retune_threshold: float = 0.15,
        retune_patience: int = 2,
        top: int = 5,
        launch_s: float | None = None,
        placements: list[str] | None = None,
    ) -> None:
        self.kinds = tuple(placements or KINDS)
        if unknown := sorted(set(self.kinds) - set(KINDS)):
            raise ValueError(f"strategy 'auto': unknown placements {unknown}; choose from {list(KINDS)}")
        if retune_threshold <= 0:
            raise ValueError(f"strategy 'auto': retune_threshold must be > 0, got {retune_threshold}")
        if retune_patience < 1:
            raise ValueError(f"strategy 'auto': retune_patience must be >= 1, got {retune_patience}")
        if launch_s is not None and launch_s < 0:
            raise ValueError(f"strategy 'auto': launch_s must be >= 0, got {launch_s}")
        self.profile_path, self.save_profile, self.launch_s = profile, save_profile, launch_s
        self.retune_threshold, self.retune_patience, self.top = retune_threshold, retune_patience, top
        self.profile: Profile | None = Profile.load(profile) if profile else None
        self.metrics: dict[str, float] = {}

    # -- planning ------------------------------------------------------------------------------------
    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        self.workflow, self.resources, self.batch = workflow, resources, batch
        self._ends = {name for name, st in workflow.stages.items() if st.end_per_sample}  # see Profile
        self._fitting: dict[tuple, bool] = {}  # plan -> passes the memory check
        self._predicted: tuple[Profile | None, dict[tuple, float]] = (None, {})  # see _predict
        self._startup_s, self._wide, self._wide_ends = process_age_s(), False, False
        self._wide_runs = 0  # iterations the profiling worker ran on every slot
        if self.profile is not None:
            if self.profile.workflow != workflow.name:
                raise ValueError(
                    f"strategy 'auto': profile {self.profile_path} measured workflow "
                    f"{self.profile.workflow!r}, this run's is {workflow.name!r}"
                )
            self.ranked = self.rank()
            self.current = self.ranked[0]
            self._profiling = False
            return self.current.plan
        self._profiling = True
        self.profile = Profile(workflow.name, accelerator=resources.accelerator)
        replicas = len(resources.slots)
        first = BatchShape(batch.rollout_batch_size, batch.group_size, batch.micro_batch_for(2 * replicas))
        if workflow.stages[workflow.order[0]].sticky:  # its state is cut once: profile the final cut
            first.micro_batch_size = batch.micro_batch_for(replicas)
        plan = one_worker_plan(workflow, resources, first, 1)
        if (
            "one_worker" not in self.kinds
            or not one_worker_allowed(workflow, resources)
            or not self._fits(plan)
        ):
            plan = CollocatedStrategy(replicas=replicas).plan(workflow, resources, first)
            plan.strategy = "auto"
        plan.notes = f"profiling: {plan.notes}"
        self.current = Candidate("profiling", plan)
        return plan

    def rank(self) -> list[Candidate]:
        assert self.profile is not None
        return self._candidates(self.profile)

    def on_launch(self, info: RunInfo) -> None:
        self.info, self.queued = info, False
        self._ahead: Candidate | None = None  # the plan whose workers start in the background
        self.seen: deque[_Seen] = deque(maxlen=self.retune_patience + 1)
        self._drift, self._probe_from, self._fresh = 0, None, False
        self.on_relaunch(info)
        if not self._profiling:
            self._print_ranking(f"from profile {self.profile_path}")

    def on_relaunch(self, info: RunInfo) -> None:
        """Record what starting the current plan's workers took; while no worker process has
        started, estimate what one would take."""
        assert self.profile is not None
        if self._in_process(self.current.plan):
            self.profile.inprocess_launch_s = info.launch_s
        if not self._in_process(self.current.plan) or not info.separate_processes:
            self.profile.launch_s, self.profile.launch_estimated = info.launch_s, False
        elif self._profiling or self.profile.launch_estimated:
            est = self.launch_s
            if est is None:
                est = launch_estimate(self.profile.inprocess_launch_s, self._startup_s)
            self.profile.launch_s, self.profile.launch_estimated = est, True

    def holds_after(self, iteration: int) -> bool:
        # while measuring, while workers start ahead, and while a drift may turn into a new plan,
        # the next iteration waits (a switch takes effect right after this one)
        return self._profiling or self._ahead is not None or self._drift > 0 or self._probe_from is not None

    # -- each iteration -----------------------------------------------------------------------------
    def observe(
        self,
        iteration: int,
        seconds: float,
        spans: list[Span],
        micro_batch: int,
        queued: bool,
        ahead_ready: bool = False,
    ) -> Replan | None:
        self.queued = queued
        if self._profiling:
            self.seen.append(_Seen(iteration, micro_batch, seconds, spans))
            return self._profile_step(iteration, seconds, spans, micro_batch)
        predicted = self._predict(micro_batch)
        self.metrics = {
            "auto/predicted_s": predicted,
            "auto/measured_s": seconds,
            "auto/micro_batch": micro_batch,
        }
        if self._ahead is not None:  # sharing the cores with their start-up: not compared
            if ahead_ready:
                return self._switch(self._ahead, iteration, "the workers started ahead are up")
            return None
        if self._fresh:  # the first iteration on new workers: its first calls paid their set-up
            self._fresh = False
            return None
        self.seen.append(_Seen(iteration, micro_batch, seconds, spans))
        if self._probe_from is not None and micro_batch == self.current.micro_batch:
            return self._after_probe(iteration)
        if abs(seconds - predicted) > self.retune_threshold * predicted:
            self._drift += 1
        else:
            self._drift = 0
        if self._drift < self.retune_patience or self._probe_from is not None:
            return None
        self._drift = 0
        recent = [s for s in self.seen if s.micro_batch == micro_batch][-self.retune_patience :]
        guess = self.profile.shifted(self._measured(recent))
        ranked = self._candidates(guess)
        best = self._choose(ranked, iteration)
        why = (
            f"measured {statistics.fmean(s.seconds for s in recent):.3f} s per iteration vs predicted "
            f"{predicted:.3f} s for {len(recent)} iterations"
        )
        self.profile = guess
        if self._is_current(best):
            self._recalibrate(recent)
            log.info("auto: iteration %d: %s; re-fitted, the plan stays", iteration, why)
            return None
        self._probe_from = micro_batch
        return self._switch(best, iteration, f"{why}; re-fitted from them")

    # -- steps ----------------------------------------------------------------------------------------
    def _profile_step(
        self, iteration: int, seconds: float, spans: list[Span], micro_batch: int
    ) -> Replan | None:
        assert self.profile is not None
        n = len(self.resources.slots)
        if self._wide:  # the one worker on every slot ran: its speed-up over one slot
            self._wide_runs += 1
            self.profile.add_speedup(n, spans, micro_batch)
            if self._wide_ends:  # profiled at one granularity: its end-of-iteration costs too
                widths = dict.fromkeys(self.workflow.stages, n)
                self.profile.add_spans(spans, micro_batch, widths=widths, per_sample_ends=self._ends)
                self.profile.refit()
            ranked, again = self.rank(), self._wide_runs == 1 and iteration < self.info.max_iterations
            if again and self._narrows(ranked, iteration):
                log.info(
                    "auto: iteration %d: one worker measured slower on %d slots than on fewer; timing "
                    "it again before narrowing it (its first iteration there paid the set-up)", iteration, n,
                )  # fmt: skip
                return None
            return self._profiled(iteration, ranked)
        self.profile.add_spans(spans, micro_batch, skip_first=iteration == 1, per_sample_ends=self._ends)
        wide = self._wide_plan(micro_batch)
        if iteration < PROFILING_ITERATIONS:
            second = self.batch.micro_batch_for(n)
            if not (self.workflow.stages[self.workflow.order[0]].sticky or second == micro_batch):
                return Replan(self._at(second), f"profiling: micro-batch {micro_batch} -> {second}")
            if wide is None:  # the same size again, for the costs the first iteration's set-up hid
                return None
        self.profile.refit()
        if iteration > 1:
            self._recalibrate([self.seen[-1]])
        else:  # one worker, one thread: what no span covers (the wide iteration uses every core)
            self.profile.overhead_s = max(0.0, seconds - sum(s.end - s.start for s in spans))
        if wide is not None:
            self._wide, self._wide_ends, self.current = True, iteration == 1, Candidate("profiling", wide)
            return Replan(wide, f"profiling: the same worker on {n} slots, for its speed-up")
        return self._profiled(iteration)

    def _wide_plan(self, micro_batch: int) -> ExecutionPlan | None:
        """The profiling worker on every slot, when it can run and the run has an iteration for it,
        at the granularity that worker runs as a plan of its own (a sticky first stage: the one
        it has): its speed-up is then measured where it is used most, and auto, choosing it, runs on
        without a switch at a granularity whose time it has measured."""
        n, last = len(self.resources.slots), self.seen[-1].iteration >= self.info.max_iterations
        if self.current.plan.launcher != IN_PROCESS or n == 1 or last:
            return None
        if not self.workflow.stages[self.workflow.order[0]].sticky:
            micro_batch = self.batch.micro_batch_for(1)
        shape = BatchShape(self.batch.rollout_batch_size, self.batch.group_size, micro_batch)
        wide = one_worker_plan(self.workflow, self.resources, shape, n)
        return wide if self._fits(wide) else None

    def ahead(self) -> ExecutionPlan | None:
        return self._ahead.plan if self._ahead else None

    def _profiled(self, iteration: int, ranked: list[Candidate] | None = None) -> Replan | None:
        """The profile is complete: rank (unless ``ranked`` already is), save it, and take the
        best plan for the rest of the run."""
        assert self.profile is not None
        self._profiling, self._wide = False, False
        self.ranked = ranked if ranked is not None else self.rank()
        self._print_ranking(f"measured in iterations 1-{iteration}")
        if self.save_profile != "":
            path = Path(self.save_profile or self.info.run_dir / "profile.json")
            log.info("auto: profile saved to %s", self.profile.save(path))
        best = self._choose(self.ranked, iteration)
        if self._is_current(best):
            return None
        why = "the least predicted time for the remaining iterations"
        here_now, there = self._in_process(self.current.plan), not self._in_process(best.plan)
        if not (self.info.background_start and here_now and there):
            return self._switch(best, iteration, why)
        # its workers start now; the profiling worker trains on meanwhile, on one slot: the others'
        # cores go to the start-up (a worker on every core runs far slower beside it: docs/benchmarks.md)
        self._ahead = best
        here = min(
            (c for c in self.ranked if self._in_process(c.plan) and len(c.plan.groups[0].slots) == 1),
            key=lambda c: c.predicted_s,
            default=self.current,
        )
        log.info(
            "auto: iteration %d: %s: starting the workers of %s in the background; %s trains on "
            "until they are up", iteration, why, describe(best), describe(here),
        )  # fmt: skip
        if self._is_current(here):
            return None
        self.current = here
        return Replan(here.plan, f"iteration {iteration}: while workers start ahead: {describe(here)}")

    def _after_probe(self, iteration: int) -> Replan | None:
        """The new granularity has run: re-fit every stage from the drifted iterations at both
        sizes and take the best plan again."""
        recent = [s for s in self.seen if s.micro_batch in (self._probe_from, self.current.micro_batch)]
        self._probe_from, self._drift = None, 0
        self.profile = self._measured(recent)
        self._recalibrate([s for s in recent if s.micro_batch == self.current.micro_batch])
        best = self._choose(self._candidates(self.profile), iteration)
        if self._is_current(best):
            log.info("auto: iteration %d: re-fitted at two granularities, the plan stays", iteration)
            return None
        return self._switch(best, iteration, "re-fitted at two granularities")

    def _narrows(self, ranked: list[Candidate], iteration: int) -> bool:
        """Whether the plan auto would take now is the profiling worker on fewer slots: a choice
        resting on the one iteration it timed on all of them, and one that no later iteration
        would question (re-tuning checks the plan that runs, and that one was measured)."""
        best = min(ranked, key=lambda c: self._rest_key(c, iteration))
        return self._widened(best.plan) and best.plan.layout() != self.current.plan.layout()

    def _rest_s(self, c: Candidate, iteration: int) -> float:
        """Predicted seconds of the rest of the fit on ``c``: its start-up plus the remaining
        iterations."""
        return self._start_s(c) + (self.info.max_iterations - iteration) * c.predicted_s

    def _rest_key(self, c: Candidate, iteration: int) -> tuple[float, bool]:
        """What choosing minimises: the rest of the fit, a tie kept by the workers running."""
        return self._rest_s(c, iteration), c.plan.layout() != self.current.plan.layout()

    def _choose(self, ranked: list[Candidate], iteration: int) -> Candidate:
        """The candidate with the least predicted rest of the fit (:meth:`_rest_s`). While the
        next iteration is already queued on the current workers, only their granularity can
        change."""
        assert self.profile is not None
        remaining = self.info.max_iterations - iteration
        here = [c for c in ranked if c.plan.layout() == self.current.plan.layout()]
        pool = here if self.queued and here else ranked

        def rest_s(c: Candidate) -> float:
            return self._rest_s(c, iteration)

        best, fastest = min(pool, key=lambda c: self._rest_key(c, iteration)), ranked[0]
        line = (
            f"auto: iteration {iteration}: {describe(best)}: predicted {best.predicted_s:.3f} s per "
            f"iteration, {rest_s(best):.2f} s for the {remaining} remaining with {self._start_s(best):.2f} s "
            "of start-up"
        )
        if fastest is not best:
            line += (
                f"; the fastest per iteration, {describe(fastest)} ({fastest.predicted_s:.3f} s), "
                f"would take {rest_s(fastest):.2f} s with {self._start_s(fastest):.2f} s of start-up"
            )
        est = " (estimated)" if self.profile.launch_estimated else ""
        log.info("%s; worker processes start in %.2f s%s", line, self.profile.launch_s, est)
        return best

    def _start_s(self, c: Candidate) -> float:
        """Seconds to start ``c``'s workers: none if they are the ones running, or the in-process
        worker on other slots (it takes them in place: ``InProcessRuntime.adopt``)."""
        assert self.profile is not None
        if c.plan.layout() == self.current.plan.layout() or self._widened(c.plan):
            return 0.0
        return self.profile.inprocess_launch_s if self._in_process(c.plan) else self.profile.launch_s

    def _widened(self, plan: ExecutionPlan) -> bool:
        """Whether ``plan`` is the running in-process plan on other CPU slots."""
        now = self.current.plan
        return plan.launcher == now.launcher == IN_PROCESS and now.rethreads(plan)

    def _in_process(self, plan: ExecutionPlan) -> bool:
        return plan.launcher == IN_PROCESS or not self.info.separate_processes

    def _switch(self, best: Candidate, iteration: int, why: str) -> Replan:
        old = self.current
        self.current, self._ahead = best, None  # the workers started ahead take over, or go
        self._fresh = best.plan.layout() != old.plan.layout()
        change = (
            f"micro-batch {old.micro_batch} -> {best.micro_batch}"
            if best.plan.layout() == old.plan.layout()
            else f"{describe(old)} -> {describe(best)}"
        )
        reason = f"iteration {iteration}: {why}: {change} (predicted {best.predicted_s:.3f} s per iteration)"
        log.info("auto: %s", reason)
        return Replan(best.plan, reason)

    # -- helpers -------------------------------------------------------------------------------------------
    def _candidates(self, profile: Profile) -> list[Candidate]:
        """Every candidate that fits in memory, ranked under ``profile``."""
        return candidates(self.workflow, self.resources, self.batch, profile, self._fits, self.kinds)

    def _fits(self, plan: ExecutionPlan) -> bool:
        """Whether ``plan`` passes the memory check; asked once per plan and granularity (every
        re-ranking asks again for the same candidates, and their memory does not change)."""
        key = (
            plan.layout(),
            tuple(g.context_switch for g in plan.groups),
            tuple(sorted(plan.micro_batch_size.items())),
        )
        if key not in self._fitting:
            self._fitting[key] = not memory_problems(self.workflow, plan)
        return self._fitting[key]

    def _is_current(self, c: Candidate) -> bool:
        return c.plan.layout() == self.current.plan.layout() and c.micro_batch == self.current.micro_batch

    def _predict(self, micro_batch: int) -> float:
        """Predicted seconds of the current placement at ``micro_batch``, simulated once per
        profile, overhead, plan and size (every iteration asks; a lagged plan's simulation is
        about a millisecond, 1% of a short iteration)."""
        assert self.profile is not None
        key = (self.profile.overhead_s, self.current.plan.layout(), micro_batch)
        if self._predicted[0] is not self.profile or self._profiling:  # (profiling edits it in place)
            self._predicted = (self.profile, {})
        cache = self._predicted[1]
        if key not in cache:
            plan, batch = self._at(micro_batch), self.batch.rollout_batch_size
            cache[key] = simulate(self.workflow, plan, self.profile, batch)
        return cache[key]

    def _at(self, micro_batch: int) -> ExecutionPlan:
        """The current placement at granularity ``micro_batch``."""
        plan = self.current.plan
        return dataclasses.replace(plan, micro_batch_size={ch: micro_batch for ch in plan.micro_batch_size})

    def _measured(self, seen: list[_Seen]) -> Profile:
        """A profile of just ``seen`` (fitted), keeping the current one's launch, message and
        overhead costs and speed-ups."""
        assert self.profile is not None
        cleared = {"stages": {}, "sync_s": {}, "points": {}, "end_samples": {}, "sync_samples": {}}
        p = Profile.from_dict({**self.profile.to_dict(), **cleared})
        widths = {st: g.slots_per_replica for g in self.current.plan.groups for st in g.stages}
        for s in seen:
            p.add_spans(s.spans, s.micro_batch, widths=widths, per_sample_ends=self._ends)
        p.refit()
        return p

    def _recalibrate(self, seen: list[_Seen]) -> None:
        """Set the per-iteration overhead so the simulation of what ran matches what was measured."""
        assert self.profile is not None
        self.profile.overhead_s = 0.0
        sims = [self._predict(s.micro_batch) for s in seen]
        self.profile.overhead_s = max(0.0, statistics.fmean(s.seconds - p for s, p in zip(seen, sims)))

    def _print_ranking(self, source: str) -> None:
        lines = [f"auto: plans ranked by predicted seconds per iteration ({source}):"]
        for i, c in enumerate(self.ranked[: self.top], 1):
            lines.append(f"  {i}. {c.predicted_s:7.3f} s  {describe(c)}")
        log.info("%s", "\n".join(lines))
