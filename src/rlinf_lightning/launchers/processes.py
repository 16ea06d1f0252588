"""Processes launcher: one OS process per worker (replica) of the plan (``torch.multiprocessing``).

Workers fork from a fork server (:func:`worker_context`) that imported this package once: a
spawned interpreter re-imports torch and this package in every worker (2.6 s of one core here),
so two workers starting beside a training worker took the cores it trains on (auto's start-up
ahead), and every new runtime paid it again. The server runs no torch op, so its children start
with no thread pool to inherit; each takes the driver's environment as it is when it starts.
Where there is no fork server (Windows) workers are spawned.

On CPU a device slot is a process with its own torch thread count, so two slots of one thread
each really run in parallel; on GPU each process sees only its replica's GPUs
(``CUDA_VISIBLE_DEVICES``). Channels between workers are shared-memory queues; channels within a
worker stay in-process. The driver talks to each worker over a command queue and watches every
process: a stage that raises comes back as a :class:`StageError` with the worker's traceback, and
a worker that dies (SIGKILL, OOM killer) ends the run with :class:`WorkerDied` naming its stages,
within a second of the death. Workers end with the driver
(:func:`~rlinf_lightning.flow.lifetime.exit_with_parent`) if it is killed; they are not daemonic,
so a stage may start processes of its own (a vLLM engine), and the runtime shuts them down at
interpreter exit instead.
"""

from __future__ import annotations

import atexit
import os
import queue
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

from rlinf_lightning.flow.channel import ChannelAborted, ChannelTimeout, SharedMemoryChannel
from rlinf_lightning.flow.collective import Rendezvous, free_port
from rlinf_lightning.flow.lifetime import exit_with_parent
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.worker import StageError, Worker
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers.base import (
    ABORT_GRACE_S,
    REPLY_MARGIN_S,
    Launcher,
    Runtime,
    WorkerDied,
    first_cause,
    noted,
)
from rlinf_lightning.malloc import tune_malloc

LIVENESS_POLL_S = 0.2  # while replies are missing, how often the driver checks its workers are alive
EXIT_S = 5.0  # how long worker processes get to exit after teardown before they are killed (and to die after)


def _worker_main(name: str, build: dict[str, Any], commands: Any, replies: Any, parent_pid: int) -> None:
    exit_with_parent(parent_pid)
    os.environ.clear()  # the driver's now, as a spawned worker has it (a fork server's is older)
    os.environ.update(build["environ"])
    if build["visible_devices"] is not None:  # before anything touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = build["visible_devices"]
    if build["cores"] is not None:  # before any library sizes a thread pool by the usable cores
        os.sched_setaffinity(0, build["cores"])
    try:
        worker = build_worker(build)
    except BaseException:
        _, _, seq = commands.get()  # the answer to the first command (setup)
        replies.put((name, seq, "error", StageError("<worker>", name, traceback.format_exc())))
        return
    while True:
        cmd, args, seq = commands.get()
        try:
            out = worker.handle(cmd, args)
            replies.put((name, seq, "ok", out))
        except (StageError, ChannelAborted, ChannelTimeout) as exc:
            worker_failed(build, exc)
            replies.put((name, seq, "error", exc))
        except BaseException:
            worker_failed(build, None)
            replies.put((name, seq, "error", StageError("<worker>", name, traceback.format_exc())))
        if cmd == "shutdown":
            return


#: what the fork server imports before it forks a worker (``__main__``: the user's script, as a
#: spawned worker would import it)
PRELOAD = ["__main__", "rlinf_lightning.launchers.processes"]


def worker_context() -> Any:
    """The multiprocessing context workers start from: a fork server preloaded with
    :data:`PRELOAD` (one per driver process, started on first use, ending with the driver), else
    spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def build_worker(build: dict[str, Any]) -> Worker:
    """In the worker's own process: pin its torch threads and build the (not yet set up) Worker."""
    import torch

    ctx: StageContext = build["ctx"]
    torch.set_num_threads(ctx.num_threads or 1)
    tune_malloc()
    return Worker(
        build["group"],
        ctx.replica,
        build["workflow"],
        build["links"],
        build["queues"],
        ctx,
        build["timeout_s"],
        build["abort"],
        sync_meet=build["sync_meet"],
        slot_turns=build["slot_turns"],
    )


def worker_failed(build: dict[str, Any], exc: BaseException | None) -> None:
    """Release the other workers at once (they wait on channels that will stay empty)."""
    if not isinstance(exc, ChannelAborted) and build["abort"] is not None:
        build["abort"].set()


class ProcessRuntime(Runtime):
    def __init__(self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float) -> None:
        super().__init__(workflow, plan, timeout_s)
        self.mp = worker_context()
        self.abort = self.mp.Event()
        self.queues = {
            n: SharedMemoryChannel(n, timeout_s, self.abort, self.mp, copy=sync)
            for n, sync in self.queue_names().items()
        }
        # a reply queue per worker: a worker killed while its queue's feeder thread held the
        # queue's write lock (a process-shared semaphore, never released by a dead holder) would
        # otherwise silence every other worker's replies, and a restart could not ask the
        # learners where they stopped
        self.replies = {w: self.mp.Queue() for w in self.workers}
        self._backlog: dict[tuple[str, int], tuple[str, str, Any]] = {}  # (worker, command) -> reply
        self._seq = 0  # the number of the last command sent
        self.commands = {w: self.mp.Queue() for w in self.workers}
        meet = {g.name: Rendezvous(g.name, "127.0.0.1", free_port()) for g in plan.groups if g.replicas > 1}
        sync_meet = {
            ch: Rendezvous(f"sync:{ch}", "127.0.0.1", free_port())
            for ch, link in self.links.items()
            if link.broadcast
        }
        self.procs: dict[str, Any] = {}
        try:
            self._start(meet, sync_meet)
        except BaseException:  # a worker that cannot start: stop those that did
            self._closed = True
            for p in self.procs.values():
                p.kill()
                p.join(EXIT_S)
            raise
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the workers
        self._setup()

    def _start(self, meet: dict[str, Rendezvous], sync_meet: dict[str, Rendezvous]) -> None:
        plan = self.plan
        environ = dict(os.environ)  # the driver's now: every worker starts with it
        for g, r in plan.workers:
            name, slots = g.worker_name(r), g.replica_slots(r)
            build = {
                **self.worker_build(g, r, rendezvous=meet.get(g.name)),
                "abort": self.abort,
                "sync_meet": sync_meet,
                "visible_devices": None if plan.accelerator == "cpu" else plan.visible_devices(slots),
                "cores": plan.cores_of(slots),
                "environ": environ,
            }
            p = self.mp.Process(
                target=_worker_main,
                args=(name, build, self.commands[name], self.replies[name], os.getpid()),
                name=f"rlinf-{name}",
            )
            p.start()
            self.procs[name] = p

    def _submit(self, workers: list[str], cmd: str, *args: Any) -> tuple[int, list[str]]:
        self._seq += 1
        for w in workers:
            if self.procs[w].is_alive():
                self.commands[w].put((cmd, args, self._seq))
        return self._seq, list(workers)

    def _reply(self, pending: set[str], seq: int) -> tuple[str, str, Any]:
        """The next reply of a pending worker to command ``seq``; its answers to other commands
        (the next iteration, already queued) wait in the backlog until those are collected, and
        those to commands given up on (after a failure) are never asked for."""
        for name in pending:
            if (name, seq) in self._backlog:
                return self._backlog.pop((name, seq))
        readers = {self.replies[n]._reader: n for n in pending}  # what a Queue's get waits on
        while True:
            ready = wait(list(readers), timeout=LIVENESS_POLL_S)
            if not ready:
                raise queue.Empty
            for r in ready:
                name, s, status, value = self.replies[readers[r]].get()
                if s == seq:
                    return name, status, value
                self._backlog[(name, s)] = (name, status, value)

    def _collect(self, handle: tuple[int, list[str]], deadline_s: float | None = None) -> dict[str, Any]:
        """One reply from each worker; a failure (an error or a dead process) releases the others
        and waits up to ``ABORT_GRACE_S`` for them before raising."""
        seq, workers = handle
        pending, out, errors = set(workers), {}, []
        wait_s = deadline_s or self.timeout_s + REPLY_MARGIN_S
        deadline = time.monotonic() + wait_s
        while pending:
            try:
                name, status, value = self._reply(pending, seq)
            except queue.Empty:
                for n in sorted(pending):
                    if not self.procs[n].is_alive():
                        pending.discard(n)
                        errors.append(WorkerDied(n, self.stages_of[n], self.procs[n].exitcode))
                        self._failed(errors)
                        deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
                if time.monotonic() > deadline:
                    if errors:
                        break
                    self._abort()
                    late = TimeoutError(f"workers {sorted(pending)} did not answer within {wait_s:.0f} s")
                    raise noted(late, pending, out) from None
                continue
            pending.discard(name)
            if status == "error":
                errors.append(value)
                self._failed(errors)
                deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
            else:
                out[name] = value
        if errors:
            raise noted(first_cause(errors), pending, out)
        return out

    def _failed(self, errors: list[BaseException]) -> None:
        if len(errors) == 1:
            self._abort()

    def _abort(self) -> None:
        self.abort.set()

    def _close(self) -> None:
        atexit.unregister(self.shutdown)
        deadline = time.monotonic() + EXIT_S
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=EXIT_S)


class ProcessLauncher(Launcher):
    """One OS process per worker (forked from a preloaded server); shared-memory channels between them."""

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        return ProcessRuntime(workflow, plan, timeout_s)
