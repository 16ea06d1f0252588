"""Worker: hosts stages on one slot and runs the plan's schedule for an iteration.

It pulls micro-batches from each hosted stage's input channel, calls the stage, pushes results to
the output channel, forwards the end-of-iteration marker, hands sync state along sync edges, and
records a span per stage call so the run can report seconds per stage and write a trace.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

from rlinf_lightning.flow.channel import Channel, EndOfIteration
from rlinf_lightning.flow.plan import WorkerGroupSpec
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.flow.workflow import Workflow


@dataclass
class Span:
    worker: str
    stage: str
    what: str  # "process" | "end_iteration" | "onload" | "offload" | "sync"
    start: float
    end: float
    samples: int = 0


class StageError(RuntimeError):
    """A stage raised; carries the stage, the worker and the worker-side traceback."""

    def __init__(self, stage: str, worker: str, tb: str) -> None:
        self.stage, self.worker, self.tb = stage, worker, tb
        super().__init__(f"stage {stage!r} failed on worker {worker!r}:\n{tb}")

    def __reduce__(self):  # keep fields across pickling (process and Ray launchers)
        return (StageError, (self.stage, self.worker, self.tb))


class Worker:
    def __init__(
        self,
        spec: WorkerGroupSpec,
        workflow: Workflow,
        channels: dict[str, Channel],
        ctx: StageContext,
    ) -> None:
        self.spec = spec
        self.workflow = workflow
        self.channels = channels
        self.ctx = ctx
        self.stages: dict[str, Stage] = {n: workflow.stages[n] for n in spec.stages}
        self.spans: list[Span] = []

    def _guard(self, stage: str, fn, *args):
        try:
            return fn(*args)
        except StageError:
            raise
        except Exception:
            raise StageError(stage, self.spec.name, traceback.format_exc()) from None

    def _timed(self, stage: str, what: str, fn, *args, samples: int = 0):
        t0 = time.time()  # wall clock: comparable across processes (and, roughly, machines)
        out = self._guard(stage, fn, *args)
        self.spans.append(Span(self.spec.name, stage, what, t0, time.time(), samples))
        return out

    def setup(self) -> None:
        for name, st in self.stages.items():
            self._guard(name, st.setup, self.ctx)
            if self.spec.context_switch:
                self._guard(name, st.offload)

    def teardown(self) -> None:
        """Each stage's ``teardown``; errors are reported, not raised (the run is ending)."""
        for name, st in self.stages.items():
            try:
                st.teardown()
            except Exception:
                print(f"teardown of stage {name!r} failed:\n{traceback.format_exc()}", flush=True)

    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        st = self.stages[stage]
        if self.spec.context_switch:
            self._guard(stage, st.onload)
        try:
            return self._guard(stage, lambda: getattr(st, method)(*args, **kwargs))
        finally:
            if self.spec.context_switch:
                self._guard(stage, st.offload)

    # -- one iteration -------------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> dict[str, dict[str, float]]:
        metrics: dict[str, dict[str, float]] = {}
        for name, st in self.stages.items():
            self._guard(name, st.begin_iteration, iteration)
        if self.spec.schedule == "sequential":
            for name in self.spec.stages:
                if self.spec.context_switch:
                    self._timed(name, "onload", self.stages[name].onload)
                while not self._step(
                    name, self.channels[self.workflow.input_edge(name).channel].get(), metrics
                ):
                    pass
                if self.spec.context_switch:
                    self._timed(name, "offload", self.stages[name].offload)
        else:
            self._run_interleaved(metrics)
        self._receive_sync()
        return metrics

    def _run_interleaved(self, metrics: dict[str, dict[str, float]]) -> None:
        pending = list(self.spec.stages)
        idle_since = time.monotonic()
        while pending:
            progressed = False
            for name in list(pending):
                got, item = self.channels[self.workflow.input_edge(name).channel].poll()
                if got:
                    progressed = True
                    if self._step(name, item, metrics):
                        pending.remove(name)
            if progressed:
                idle_since = time.monotonic()
            else:
                # nothing waiting anywhere: block on the first pending stage's channel (with its timeout)
                name = pending[0]
                ch = self.channels[self.workflow.input_edge(name).channel]
                item = ch.get(timeout=max(0.0, ch.timeout_s - (time.monotonic() - idle_since)))
                idle_since = time.monotonic()
                if self._step(name, item, metrics):
                    pending.remove(name)

    def _step(self, name: str, item: Any, metrics: dict[str, dict[str, float]]) -> bool:
        """Handle one channel item for stage ``name``; True when the iteration ended for it."""
        st = self.stages[name]
        out_edge = self.workflow.output_edge(name)
        out = self.channels[out_edge.channel] if out_edge else None
        if isinstance(item, EndOfIteration):
            metrics[name] = self._timed(name, "end_iteration", st.end_iteration) or {}
            if out is not None:
                out.put(item)
            for e in self.workflow.sync_edges():
                if e.src == name:
                    state = self._timed(name, "sync", st.sync_state)
                    self.channels[e.channel].put(state)
            return True
        n = int(item.batch_size[0]) if item.batch_dims else 0
        result = self._timed(name, "process", st.process, item, samples=n)
        if result is not None and out is not None:
            out.put(result)
        return False

    def _receive_sync(self) -> None:
        for e in self.workflow.sync_edges():
            if e.dst in self.stages:
                state = self.channels[e.channel].get()
                if self.spec.context_switch:
                    self._timed(e.dst, "onload", self.stages[e.dst].onload)
                self._timed(e.dst, "sync", self.stages[e.dst].apply_sync, e.src, state)
                if self.spec.context_switch:
                    self._timed(e.dst, "offload", self.stages[e.dst].offload)
