"""Processes launcher: one OS process per worker of the plan (``torch.multiprocessing``, spawn).

On CPU a device slot is a process with its own torch thread count, so two slots of one thread
each really run in parallel. Channels between stages of different workers are shared-memory
queues; channels within a worker stay in-process. The driver talks to each worker over a command
queue and watches every process: a stage that raises comes back as a :class:`StageError` with the
worker's traceback, and a worker that dies (SIGKILL, OOM killer) ends the run with
:class:`WorkerDied` naming its stages, within a second of the death. Workers end with the driver
(:func:`~rlinf_lightning.flow.lifetime.exit_with_parent`) if it is killed. They are not daemonic
processes, because an actor worker starts processes of its own (the ranks of a ``ddp``/``fsdp``
train engine); the runtime shuts them down at interpreter exit instead.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import time
import traceback
from typing import Any

import torch.multiprocessing as mp
from tensordict import TensorDict

from rlinf_lightning.flow.channel import (
    Channel,
    ChannelAborted,
    ChannelTimeout,
    EndOfIteration,
    SharedMemoryChannel,
)
from rlinf_lightning.flow.lifetime import exit_with_parent
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.worker import Span, StageError, Worker
from rlinf_lightning.flow.workflow import SOURCE, Workflow
from rlinf_lightning.launchers.base import Launcher, Runtime

DRIVER = "driver"


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


def placement(workflow: Workflow, plan: ExecutionPlan) -> dict[str, str]:
    """Stage name (and the source) -> name of the worker hosting it."""
    where = {s: w.name for w in plan.workers for s in w.stages}
    where[SOURCE] = DRIVER
    return where


def remote_channels(
    workflow: Workflow, where: dict[str, str], channels: dict[str, Channel], worker: str
) -> dict[str, Channel]:
    """The cross-worker channels that ``worker`` reads or writes."""
    return {
        e.channel: ch
        for e in workflow.edges
        if (ch := channels.get(e.channel)) is not None and worker in (where[e.src], where[e.dst])
    }


def build_worker(
    spec: WorkerGroupSpec,
    workflow: Workflow,
    remote: dict[str, Channel],
    ctx: StageContext,
    timeout_s: float,
    abort: Any = None,
) -> Worker:
    """In a worker's own process: pin its threads, add in-process channels for the edges between
    its own stages to the cross-worker ones it was given, and build the (not yet set up) Worker."""
    import torch

    torch.set_num_threads(spec.num_threads or 1)
    channels = dict(remote)
    for e in workflow.edges:
        if e.channel not in channels:
            channels[e.channel] = Channel(e.channel, timeout_s, abort)
    return Worker(spec, workflow, channels, ctx)


def _remote_error(worker: str) -> StageError:
    return StageError("<worker>", worker, traceback.format_exc())


def _worker_main(
    spec: WorkerGroupSpec,
    workflow: Workflow,
    remote: dict[str, Channel],
    index: int,
    world: int,
    timeout_s: float,
    abort: Any,
    commands: Any,
    replies: Any,
    parent_pid: int,
) -> None:
    exit_with_parent(parent_pid)
    ctx = StageContext(spec.device(), index, world, spec.num_threads)
    try:
        worker = build_worker(spec, workflow, remote, ctx, timeout_s, abort)
        worker.setup()
    except BaseException as exc:
        replies.put((spec.name, "error", exc if isinstance(exc, StageError) else _remote_error(spec.name)))
        return
    replies.put((spec.name, "ok", os.getpid()))
    while True:
        cmd, args = commands.get()
        if cmd == "shutdown":
            worker.teardown()
            replies.put((spec.name, "ok", None))
            return
        try:
            if cmd == "run_iteration":
                out: Any = worker.run_iteration(*args)
            elif cmd == "call":
                stage, method, a, kw = args
                out = worker.call(stage, method, *a, **kw)
            elif cmd == "pop_spans":
                out, worker.spans = worker.spans, []
            else:
                raise ValueError(f"unknown command {cmd!r}")
            replies.put((spec.name, "ok", out))
        except (StageError, ChannelAborted, ChannelTimeout) as exc:
            abort.set()
            replies.put((spec.name, "error", exc))
        except BaseException:
            abort.set()
            replies.put((spec.name, "error", _remote_error(spec.name)))


class ProcessRuntime(Runtime):
    def __init__(self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float) -> None:
        self.workflow, self.plan, self.timeout_s = workflow, plan, timeout_s
        self.specs = {w.name: w for w in plan.workers}
        self.mp = mp.get_context("spawn")
        self.abort = self.mp.Event()
        where = placement(workflow, plan)
        self.channels: dict[str, Channel] = {}
        for e in workflow.edges:
            if where[e.src] != where[e.dst]:
                self.channels[e.channel] = SharedMemoryChannel(
                    e.channel, timeout_s, self.abort, self.mp, copy=e.sync
                )
        self.source = self.channels[workflow.input_edge(workflow.order[0]).channel]
        self.replies = self.mp.Queue()
        self.commands = {w.name: self.mp.Queue() for w in plan.workers}
        self.procs: dict[str, Any] = {}
        self._stage_worker = where
        self._closed = False
        for i, spec in enumerate(plan.workers):
            remote = remote_channels(workflow, where, self.channels, spec.name)
            args = (
                spec,
                workflow,
                remote,
                i,
                len(plan.workers),
                timeout_s,
                self.abort,
                self.commands[spec.name],
            )
            p = self.mp.Process(
                target=_worker_main,
                args=(*args, self.replies, os.getpid()),
                name=f"rlinf-{spec.name}",
            )
            p.start()
            self.procs[spec.name] = p
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the workers
        try:
            self._gather(list(self.procs), deadline_s=max(timeout_s, 120.0))
        except BaseException:
            self.shutdown()
            raise

    # -- driver side of the command protocol -----------------------------------------------------
    def _gather(self, names: list[str], deadline_s: float | None = None) -> dict[str, Any]:
        """Wait for one reply from each named worker; fail fast on an error or a dead process."""
        pending, out, errors = set(names), {}, []
        deadline = time.monotonic() + (deadline_s or self.timeout_s + 30.0)
        while pending:
            try:
                name, status, value = self.replies.get(timeout=0.2)
            except queue.Empty:
                for n in sorted(pending):
                    if not self.procs[n].is_alive():
                        self.abort.set()
                        raise WorkerDied(n, self.specs[n].stages, self.procs[n].exitcode) from None
                if time.monotonic() > deadline:
                    self.abort.set()
                    raise TimeoutError(
                        f"workers {sorted(pending)} did not answer within {deadline_s} s"
                    ) from None
                continue
            pending.discard(name)
            if status == "error":
                errors.append(value)
                # the others are now unblocked by the abort event; collect them for a short while
                deadline = min(deadline, time.monotonic() + 5.0)
            else:
                out[name] = value
        if errors:
            raise next((e for e in errors if isinstance(e, StageError)), errors[0])
        return out

    def _send(self, name: str, cmd: str, *args: Any) -> None:
        self.commands[name].put((cmd, args))

    # -- Runtime -----------------------------------------------------------------------------------
    def run_iteration(self, iteration: int, batches: list[TensorDict]) -> dict[str, dict[str, float]]:
        for name in self.procs:
            self._send(name, "run_iteration", iteration)
        for b in batches:
            self.source.put(b)
        self.source.put(EndOfIteration(iteration))
        metrics: dict[str, dict[str, float]] = {}
        for m in self._gather(list(self.procs)).values():
            metrics.update(m)
        return metrics

    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        name = self._stage_worker[stage]
        self._send(name, "call", stage, method, args, kwargs)
        return self._gather([name])[name]

    def pop_spans(self) -> list[Span]:
        for name in self.procs:
            self._send(name, "pop_spans")
        return [s for spans in self._gather(list(self.procs)).values() for s in spans]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.abort.set()  # a worker still inside a stage stops at its next channel wait
        for n, p in self.procs.items():
            if p.is_alive():
                self._send(n, "shutdown")
        deadline = time.monotonic() + 5.0
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


class ProcessLauncher(Launcher):
    """One spawned OS process per worker; shared-memory channels between them."""

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        return ProcessRuntime(workflow, plan, timeout_s)
