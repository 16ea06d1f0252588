"""Launcher and Runtime: who starts the workers of a plan, and the handle that drives them.

:class:`Runtime` holds everything the launchers share: wiring the plan, feeding an iteration's
micro-batches, merging the replicas' metrics, choosing which of several errors to raise, calling a
stage's methods on one or all of its replicas. A launcher's runtime adds only its transport: how a
command reaches a worker (``_submit``), how the answers come back (``_collect``), and how a waiting
worker is told to give up (``_abort``).
"""

from __future__ import annotations

import logging
import os
import signal
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

from tensordict import TensorDict

from rlinf_lightning.flow.channel import ChannelAborted, Message
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.sharing import baton_queues, slot_turns
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.wiring import Port, wire, worker_queues
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.flow.workflow import Workflow

log = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after a failure, how long the other workers get to come back before the run ends
# Setup loads models and meets the other replicas: it gets at least this long on a quiet machine,
# even when trainer.timeout_s (the wait for a stage's input) is set short (see setup_deadline).
SETUP_MIN_S = 120.0
# A command's reply may wait a channel's whole trainer.timeout_s plus this margin, so a stuck stage
# is reported by the channel waiting on it (which names it) before the driver gives up.
REPLY_MARGIN_S = 30.0
SHUTDOWN_S = 10.0  # how long teardown may take before the workers are stopped regardless


def oversubscription() -> float:
    """How much busier than its cores this machine is: its highest 1-, 5- and 15-minute load average
    per usable core, at least 1. The highest, because the 1-minute average lags a load that just
    rose and forgets one that paused a moment ago."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1.0, max(os.getloadavg()) / cores)


def setup_deadline(timeout_s: float) -> float:
    """How long starting and setting up the workers may take: ``max(timeout_s, SETUP_MIN_S)`` times
    :func:`oversubscription`. Start-up is CPU-bound (a process starts, imports torch, builds or loads
    a model), so on two cores at load 4 it takes about twice as long; a fixed bound made a run that
    was only slow fail (a Ray actor past 120 s beside two busy processes). A hang still ends."""
    return max(timeout_s, SETUP_MIN_S) * oversubscription()


class WorkerDied(RuntimeError):
    """A worker process exited without replying (killed, crashed in native code, out of memory)."""

    def __init__(self, worker: str, stages: list[str], exitcode: int | None, reason: str = "") -> None:
        self.worker, self.stages, self.exitcode, self.reason = worker, stages, exitcode, reason
        how = reason or f"exit code {exitcode}"
        if exitcode is not None and exitcode < 0:
            how = f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        super().__init__(f"worker {worker!r} hosting stage(s) {', '.join(stages)} died: {how}")

    def __reduce__(self):
        return (WorkerDied, (self.worker, self.stages, self.exitcode, self.reason))


def first_cause(errors: list[BaseException]) -> BaseException:
    """The error that started a failure: a stage's own error or a death, not the aborted waits."""
    for kind in (StageError, WorkerDied):
        for e in errors:
            if isinstance(e, kind):
                return e
    return next((e for e in errors if not isinstance(e, ChannelAborted)), errors[0])


def noted(exc: BaseException, silent: Iterable[str], answers: dict[str, Any]) -> BaseException:
    """``exc``, with what the driver knew when it stopped waiting: ``exc.silent``, the workers that
    had not answered (a worker that hangs is among them), and ``exc.answers``, the answers of those
    that had, by worker (a restart, ``trainer.restarts``, keeps what they finished)."""
    exc.silent, exc.answers = sorted(silent), dict(answers)
    return exc


def merge_metrics(
    results: list[dict[str, tuple[Metrics | dict[str, float], int]]],
) -> dict[str, dict[str, float]]:
    """Per stage, the replicas' metrics merged as if one replica had processed every sample, each
    by the reduction its stage declared (:class:`~rlinf_lightning.flow.metrics.Metrics`); a plain
    dict's values are means weighted by the samples that replica processed."""
    per_stage: dict[str, list[Metrics]] = {}
    for result in results:
        for stage, (metrics, samples) in result.items():
            if not isinstance(metrics, Metrics):
                metrics = Metrics.of_means(metrics, samples)
            per_stage.setdefault(stage, []).append(metrics)
    return {stage: Metrics.merged(parts).compute() for stage, parts in per_stage.items()}


class Runtime(ABC):
    """A launched plan: feed it an iteration's micro-batches, call stage methods, shut it down."""

    def __init__(self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float) -> None:
        self.workflow, self.plan, self.timeout_s = workflow, plan, timeout_s
        self.links = wire(workflow, plan)
        self.slot_turns = slot_turns(workflow, plan)  # worker -> its turns on shared slots
        self.workers = [g.worker_name(r) for g, r in plan.workers]
        self.stages_of = {g.worker_name(r): g.stages for g, r in plan.workers}
        self.info: dict[str, dict[str, Any]] = {}  # per worker: pid, torch threads, device
        self._spans: list[Span] = []
        self.queues: dict[str, Any] = {}  # the cross-worker queues, by name (each launcher's transport)
        self._running: deque[Any] = deque()  # handles of started, unfinished iterations
        self._closed = False

    def queue_names(self) -> dict[str, bool]:
        """Every cross-worker queue a launcher creates, by name: whether it carries sync state."""
        names = {n: link.edge.kind == "sync" for link in self.links.values() for n in link.queue_names()}
        return {**names, **dict.fromkeys(baton_queues(self.plan), False)}

    def worker_build(self, g: WorkerGroup, replica: int, **ctx: Any) -> dict[str, Any]:
        """What a worker in a process of its own is built from (picklable; the launcher adds its
        transport's part): its group, the workflow, the queues it reads or writes, and its context,
        whose device is numbered as that process sees its devices. ``ctx``: more of the context."""
        slots = g.replica_slots(replica)
        return {
            "group": g,
            "workflow": self.workflow,
            "links": self.links,
            "queues": {n: self.queues[n] for n in worker_queues(self.links, self.plan, g.name)},
            "ctx": StageContext(
                self.plan.device_of(slots, remapped=True),
                replica,
                g.replicas,
                g.num_threads,
                slots,
                own_process=True,
                timeout_s=self.timeout_s,
                **ctx,
            ),
            "timeout_s": self.timeout_s,
            "slot_turns": self.slot_turns.get(g.worker_name(replica)),
        }

    # -- transport (each launcher) -----------------------------------------------------------------
    @abstractmethod
    def _submit(self, workers: list[str], cmd: str, *args: Any) -> Any:
        """Send ``cmd`` to ``workers``; returns a handle for :meth:`_collect`."""

    @abstractmethod
    def _collect(self, handle: Any, deadline_s: float | None = None) -> dict[str, Any]:
        """Each worker's answer; raises :func:`first_cause` of the failures (after
        :meth:`_abort` and up to ``ABORT_GRACE_S`` for the others to come back)."""

    @abstractmethod
    def _abort(self) -> None:
        """Release every worker waiting on a channel (they raise ``ChannelAborted``)."""

    def _close(self) -> None:
        """Stop the workers (after their teardown was asked for)."""

    def adopt(self, plan: ExecutionPlan) -> bool:
        """Run ``plan`` on these very workers where its layout differs only in what they can
        change in place; returns whether it did (else the caller starts new workers)."""
        return False

    # -- shared ---------------------------------------------------------------------------------------
    def _command(self, workers: list[str], cmd: str, *args: Any, deadline_s: float | None = None) -> dict:
        return self._collect(self._submit(workers, cmd, *args), deadline_s)

    def _setup(self) -> None:
        """Set up every worker at once (replicas of a group meet in their process group)."""
        try:
            self.info = self._command(self.workers, "setup", deadline_s=setup_deadline(self.timeout_s))
        except BaseException:
            self.shutdown()
            raise
        for name, info in self.info.items():  # where each worker landed: placement questions start here
            log.debug(
                "worker %s: pid %s, device %s, %s torch thread(s), cores %s",
                name, info["pid"], info["device"], info["torch_threads"], info["cores"],
            )  # fmt: skip

    def start_iteration(self, iteration: int, batches: list[TensorDict]) -> None:
        """Queue iteration ``iteration`` with its input ``batches`` and return at once.

        At most :attr:`in_flight` iterations are outstanding: the one running and the next, which
        the workers start the moment they finish the first (see ``flow.wiring`` for why that is
        safe), or more under a lagged sync. The driver meanwhile logs, off the workers' critical
        path."""
        if len(self._running) == self.in_flight:
            raise RuntimeError(
                f"{self.in_flight} iterations are already outstanding; finish_iteration() first"
            )
        self._running.append(self._submit(self.workers, "run_iteration", iteration))
        source = Port(
            self.links[self.workflow.source_edge.channel], self.queues, 0, None, iteration % self.in_flight
        )
        for i, b in enumerate(batches):
            source.put(Message(b, key=i))
        source.end()

    def finish_iteration(self) -> dict[str, dict[str, float]]:
        """Wait for the oldest outstanding iteration; per-stage metrics once every worker ended it."""
        if not self._running:
            raise RuntimeError("no iteration is outstanding; start_iteration() first")
        results = self._collect(self._running.popleft())
        for _, spans in results.values():
            self._spans.extend(spans)
        return merge_metrics([m for m, _ in results.values()])

    def run_iteration(self, iteration: int, batches: list[TensorDict]) -> dict[str, dict[str, float]]:
        """Stream ``batches`` through the workflow; per-stage metrics once every worker ended."""
        self.start_iteration(iteration, batches)
        return self.finish_iteration()

    def finished(self, workers: list[str]) -> dict[str, int]:
        """The last iteration each of ``workers`` ran to its end (answered once each is idle)."""
        return self._command(workers, "finished")

    def abandon(self) -> None:
        """Give up on the iterations still outstanding after one failed: their answers are never
        collected (a restart runs them again on new workers)."""
        self._running.clear()

    @property
    def in_flight(self) -> int:
        """How many iterations may be outstanding at once (``Workflow.in_flight``)."""
        return self.workflow.in_flight

    @property
    def outstanding(self) -> int:
        """Iterations started and not yet finished."""
        return len(self._running)

    def replicas_of(self, stage: str) -> list[str]:
        g = self.plan.group_of(stage)
        return [g.worker_name(r) for r in range(g.replicas)]

    def call(
        self, stage: str, method: str, *args: Any, replicas: Literal["first", "all"] = "first", **kwargs: Any
    ) -> Any:
        """Call ``method`` on ``stage`` where it lives: on its first replica, or on all of them at
        once (methods that are collectives, e.g. gathering or saving a sharded state); with
        ``"all"`` the answers come back as a list in replica order."""
        workers = self.replicas_of(stage)[: 1 if replicas == "first" else None]
        out = self._command(workers, "call", stage, method, args, kwargs)
        answers = [out[w] for w in workers]
        return answers[0] if replicas == "first" else answers

    def resync(self, version: int, held_back: dict[str, list[tuple[int, Any]]] | None = None) -> None:
        """Run every sync edge once, as version ``version`` (after the checkpoint of iteration
        ``version`` was loaded into the sending stages, or the training state moved to new
        workers); lagged targets take the versions they held back (:meth:`held_back`) again."""
        self._command(self.workers, "resync", version, held_back)

    def held_back(self, version: int) -> dict[str, list[tuple[int, Any]]]:
        """Per lagged sync edge, ``(version, state)`` of what its targets hold and have not applied
        yet, idle after iteration ``version`` (``Worker.held_back``; a group's replicas hold the
        same versions, its first one answers); empty without a lagged sync."""
        if not self.workflow.max_staleness:
            return {}
        answers = self._command(self.workers, "held_back", version)
        out: dict[str, list[tuple[int, Any]]] = {}
        for worker in self.workers:
            for channel, versions in answers[worker].items():
                out.setdefault(channel, versions)
        return out

    def drain(self, version: int) -> None:
        """Every lagged sync target applies the versions up to ``version`` it still holds back
        (nothing to do without a lagged sync). Only when no iteration is outstanding."""
        if self.workflow.max_staleness:
            self._command(self.workers, "drain", version)

    def pop_spans(self) -> list[Span]:
        """Spans of the iterations run since the last call, from every worker."""
        spans, self._spans = self._spans, []
        return spans

    def shutdown(self) -> None:
        """Tear the stages down and stop the workers; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._abort()  # a worker still inside an iteration stops at its next channel wait
        try:
            self._collect(self._submit(self.workers, "shutdown"), deadline_s=SHUTDOWN_S)
        except BaseException:
            pass  # dead or stuck workers are stopped by _close
        self._close()


class Launcher(ABC):
    """Starts a plan's workers. ``separate_processes``: each worker is its own process;
    ``multi_node``: it can place workers on other machines (else every slot is on this one);
    ``background_start``: :meth:`launch` may run on a thread other than the main one (a
    strategy's workers started ahead, ``trainer.ahead``)."""

    separate_processes: bool = True
    multi_node: bool = False
    background_start: bool = True

    @abstractmethod
    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime: ...
