"""In-process launcher: every worker is a thread of this process, channels pass objects.

The embedded default for one machine and for tests. A plan with one worker runs in the calling
thread; with several, each command runs on every worker in its own thread: an iteration starts at
once, each worker's after its previous one (so a worker that finished iteration ``i`` starts the
queued next one while the others still run ``i``), any other command when the driver collects it
(the workers are idle then); ``setup`` runs one worker after another in the calling thread
(loading a ``transformers`` model is not thread-safe), so stages on thread replicas make their
process group on first use, not in ``setup``. Replicas share the process's torch thread pool (set
to the largest per-replica thread count) and each has its own copy of its stages; a data-parallel
group's replicas meet in private gloo groups (enough for ``ddp``; ``fsdp`` needs one process per
replica).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rlinf_lightning.flow.channel import Channel
from rlinf_lightning.flow.collective import Rendezvous
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.worker import Worker
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers.base import ABORT_GRACE_S, REPLY_MARGIN_S, Launcher, Runtime, first_cause
from rlinf_lightning.malloc import tune_malloc

JOIN_SLICE_S = 0.01  # the driver waits this long on one worker thread, then looks for failures again


class _Call:
    """One command on one worker, run in a thread (or inline, see ``InProcessRuntime``)."""

    def __init__(self, worker: Worker, cmd: str, args: tuple, after: _Call | None = None) -> None:
        self.worker, self.cmd, self.args, self.after = worker, cmd, args, after
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        if self.after is not None and self.after.thread is not None:  # the worker's previous iteration
            self.after.thread.join()
            self.after = None  # (its call, result and all, is not kept alive by this one)
        try:
            self.result = self.worker.handle(self.cmd, self.args)
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"rlinf-{self.worker.name}", daemon=True)
        self.thread.start()

    @property
    def finished(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


def _use_threads(plan: ExecutionPlan) -> None:
    """One process: torch's intra-op pool, shared by every worker thread, takes the plan's largest
    per-replica thread count."""
    threads = max(g.num_threads for g in plan.groups)
    if threads:
        torch.set_num_threads(threads)


class InProcessRuntime(Runtime):
    def __init__(self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float) -> None:
        import torch.distributed as dist

        super().__init__(workflow, plan, timeout_s)
        _use_threads(plan)
        tune_malloc()
        self.abort = threading.Event()
        self.queues = {n: Channel(n, timeout_s, self.abort) for n in self.queue_names()}
        meet = {g.name: Rendezvous(g.name, store=dist.HashStore()) for g in plan.groups if g.replicas > 1}
        sync_meet = {
            ch: Rendezvous(f"sync:{ch}", store=dist.HashStore())
            for ch, link in self.links.items()
            if link.broadcast
        }
        self.objects: dict[str, Worker] = {}
        self._last_run: dict[str, _Call] = {}  # per worker, its latest iteration's call
        for g, r in plan.workers:
            slots = g.replica_slots(r)
            ctx = StageContext(
                plan.device_of(slots), r, g.replicas, g.num_threads, slots,
                own_process=False, rendezvous=meet.get(g.name), timeout_s=timeout_s,
            )  # fmt: skip
            self.objects[g.worker_name(r)] = Worker(
                g, r, workflow, self.links, self.queues, ctx, timeout_s, self.abort, True, sync_meet,
                self.slot_turns.get(g.worker_name(r)),
            )  # fmt: skip
        self._setup()

    def adopt(self, plan: ExecutionPlan) -> bool:
        """The same single-worker groups on other CPU slots: only the process's torch thread pool
        changes (auto's profiling worker widened to every slot, or narrowed back to one while
        worker processes start beside it, keeps its state and its set-up). Engines that size
        their own threads at set-up (vLLM's) keep them."""
        if not self.plan.rethreads(plan):
            return False
        _use_threads(plan)
        self.plan = plan
        return True

    def _submit(self, workers: list[str], cmd: str, *args: Any) -> list[_Call]:
        """An iteration on several workers starts now, each worker's call after its previous
        iteration's; anything else runs when collected (in the calling thread for one worker)."""
        if cmd != "run_iteration" or len(workers) == 1:
            return [_Call(self.objects[w], cmd, args) for w in workers]
        calls = [_Call(self.objects[w], cmd, args, self._last_run.get(w)) for w in workers]
        for w, c in zip(workers, calls):
            self._last_run[w] = c
            c.start()
        return calls

    def _collect(self, calls: list[_Call], deadline_s: float | None = None) -> dict[str, Any]:
        if len(calls) == 1 or calls[0].cmd == "setup":  # here, in this thread, one after another
            for c in calls:
                c.run()
                if c.error is not None:
                    break
        else:
            for c in calls:
                if c.thread is None:
                    c.start()
            wait_s = deadline_s or self.timeout_s + REPLY_MARGIN_S
            deadline = time.monotonic() + wait_s
            grace_end = None
            while not all(c.finished for c in calls):
                if grace_end is None and any(c.error is not None for c in calls if c.finished):
                    self._abort()
                    grace_end = time.monotonic() + ABORT_GRACE_S
                now = time.monotonic()
                if (grace_end is not None and now > grace_end) or now > deadline:
                    break
                # the call may finish between the loop's check and this line: then join nothing
                pending = next((c for c in calls if not c.finished), None)
                if pending is not None:
                    pending.thread.join(timeout=JOIN_SLICE_S)
            if not all(c.finished for c in calls) and not any(c.error for c in calls if c.finished):
                self._abort()
                stuck = [c.worker.name for c in calls if not c.finished]
                raise TimeoutError(f"workers {stuck} did not answer within {wait_s:.0f} s")
        errors = [c.error for c in calls if c.error is not None]
        if errors:
            self._abort()
            raise first_cause(errors)
        return {c.worker.name: c.result for c in calls}

    def _abort(self) -> None:
        self.abort.set()


class InProcessLauncher(Launcher):
    """Workers as threads of the driver process; objects pass by reference."""

    separate_processes = False

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        return InProcessRuntime(workflow, plan, timeout_s)
