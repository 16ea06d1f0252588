"""In-process launcher: every worker is a thread of this process, channels pass objects.

The embedded default for one machine and for tests. A plan with one worker runs in the calling
thread; with several, each worker runs its part of an iteration in its own thread.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.channel import Channel, EndOfIteration
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.worker import Span, Worker
from rlinf_lightning.flow.workflow import SOURCE, Workflow
from rlinf_lightning.launchers.base import Launcher, Runtime


class InProcessRuntime(Runtime):
    def __init__(self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float) -> None:
        self.workflow = workflow
        threads = max(w.num_threads for w in plan.workers)
        if threads:  # one process: torch's intra-op pool is shared by every worker thread
            torch.set_num_threads(threads)
        self.abort = threading.Event()
        self.channels = {e.channel: Channel(e.channel, timeout_s, self.abort) for e in workflow.edges}
        self.source = self.channels[next(e.channel for e in workflow.edges if e.src == SOURCE)]
        self.workers = [
            Worker(
                spec,
                workflow,
                self.channels,
                StageContext(spec.device(), i, len(plan.workers), spec.num_threads),
            )
            for i, spec in enumerate(plan.workers)
        ]
        self._stage_worker = {s: w for w in self.workers for s in w.stages}
        for w in self.workers:
            w.setup()

    def run_iteration(self, iteration: int, batches: list[TensorDict]) -> dict[str, dict[str, float]]:
        for b in batches:
            self.source.put(b)
        self.source.put(EndOfIteration(iteration))
        if len(self.workers) == 1:
            return self.workers[0].run_iteration(iteration)
        results: dict[str, dict[str, float]] = {}
        errors: list[BaseException] = []

        def run(w: Worker) -> None:
            try:
                results.update(w.run_iteration(iteration))
            except BaseException as exc:
                errors.append(exc)
                self.abort.set()

        threads = [threading.Thread(target=run, args=(w,), name=w.spec.name) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # the first failure is the cause; the others are waits it aborted
            raise next((e for e in errors if type(e).__name__ == "StageError"), errors[0])
        return results

    def shutdown(self) -> None:
        for w in self.workers:
            w.teardown()
        self.workers = []

    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._stage_worker[stage].call(stage, method, *args, **kwargs)

    def pop_spans(self) -> list[Span]:
        spans = [s for w in self.workers for s in w.spans]
        for w in self.workers:
            w.spans.clear()
        return spans


class InProcessLauncher(Launcher):
    """Workers as threads of the driver process; objects pass by reference."""

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        return InProcessRuntime(workflow, plan, timeout_s)
