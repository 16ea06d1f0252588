"""Worker: one replica of a worker group; hosts the group's stages and runs one iteration.

A worker reads each hosted stage's inputs (its stream, a loop's messages), calls the stage, sends
the result on (down the stream, round the loop, or back to the loop head that asked), marks the
end of the iteration on its outputs once a stage has seen the end of all its inputs, hands sync
state along sync edges and applies the versions a hosted stage is due (``flow.sync_edges``), and
records a span per stage call (``flow.trace``), so the run can report seconds per stage and write
a trace. Every launcher runs the same worker; they differ only in where it lives (a thread, a
process, a Ray actor) and in the queues it is given.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from rlinf_lightning.errors import RunError
from rlinf_lightning.flow.channel import Channel, ChannelTimeout, EndOfIteration, Message
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.plan import WorkerGroup
from rlinf_lightning.flow.sharing import SlotTurns, turns_of
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.flow.sync_edges import SyncEdges
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.wiring import Link, Port
from rlinf_lightning.flow.workflow import SOURCE, Workflow

log = logging.getLogger(__name__)

IDLE_SLICE_S = 0.002  # how long an idle interleaved worker waits on one input before looking at the next


class StageError(RuntimeError):
    """A stage raised; carries the stage, the worker and the worker-side traceback.

    ``kind`` says what ended it: ``error`` (anything: the message is the traceback), ``stopped``
    (the stage stopped the run on purpose, a :class:`~rlinf_lightning.errors.RunError` such as a
    non-finite guard's) or ``out_of_memory`` (``torch.OutOfMemoryError`` on a GPU, ``MemoryError``
    on the host). For the last two ``line`` is the one-line message users see; the traceback is
    kept for the run's log file."""

    def __init__(
        self, stage: str, worker: str, tb: str, kind: str = "error", line: str | None = None
    ) -> None:
        self.stage, self.worker, self.tb, self.kind, self.line = stage, worker, tb, kind, line
        super().__init__(line or f"stage {stage!r} failed on worker {worker!r}:\n{tb}")

    def __reduce__(self):  # keep fields across pickling (process and Ray launchers)
        return (StageError, (self.stage, self.worker, self.tb, self.kind, self.line))


@dataclass
class _StageRun:
    """One stage's progress through the current iteration."""

    inputs: list[Port]
    ends: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    samples: int = 0
    done: bool = False
    metrics: Metrics | dict[str, float] = field(default_factory=dict)


class Worker(SyncEdges):
    """Replica ``replica`` of ``group``.

    Args:
        group: the plan's group.
        replica: this worker's index in the group.
        workflow: the workflow; this worker hosts ``group.stages`` (copies, if ``copy_stages``).
        links: the wired edges (``flow.wiring.wire``).
        queues: the cross-worker queues this worker reads or writes, by name.
        ctx: device and data-parallel context handed to the stages.
        timeout_s: longest wait for any input before the iteration fails.
        abort: the run's abort event (set when any worker fails).
        copy_stages: use private copies of the stage objects (replicas that share one process).
        sync_meet: per broadcast sync edge (channel), where its process group meets.
        slot_turns: this worker's part in the turns on the slots it shares with other groups'
            workers (``flow.sharing``); their baton queues are in ``queues``.
    """

    def __init__(
        self,
        group: WorkerGroup,
        replica: int,
        workflow: Workflow,
        links: dict[str, Link],
        queues: dict[str, Channel],
        ctx: StageContext,
        timeout_s: float,
        abort: Any,
        copy_stages: bool = False,
        sync_meet: dict[str, Any] | None = None,
        slot_turns: list[SlotTurns] | None = None,
    ) -> None:
        self.group, self.replica, self.name = group, replica, group.worker_name(replica)
        self.workflow, self.ctx, self.timeout_s = workflow, ctx, timeout_s
        stages = {n: workflow.stages[n] for n in group.stages}
        self.stages: dict[str, Stage] = copy.deepcopy(stages) if copy_stages else stages
        self.spans: list[Span] = []
        self.port_sets: list[dict[str, Port]] = [{} for _ in range(workflow.in_flight)]  # by iteration
        for ch, link in links.items():
            e = link.edge
            if e.dst in self.stages or (e.src != SOURCE and e.src in self.stages):
                local = Channel(ch, timeout_s, abort) if link.mode == "local" else None
                for parity, ports in enumerate(self.port_sets):
                    ports[ch] = Port(link, queues, replica, local, parity)
        self.ports = self.port_sets[0]
        self.turns = turns_of(workflow, group)
        self.sync_meet = dict(sync_meet or {})
        self._sync_groups: dict[str, Any] = {}
        self._broadcasts: list[tuple[Port, Any]] = []  # (port, state) to broadcast after the turns
        self.slot_turns = list(slot_turns or [])
        self._batons = {t.slot: queues[t.inbox] for t in self.slot_turns}
        self._queues = queues
        self._holding: set[int] = set()  # shared slots whose baton this worker holds
        self._set_up: list[str] = []  # stages whose setup began: only those are torn down
        self._pending_sync: dict[str, tuple[str, Any]] = {}  # stage -> (source, state) to apply in its turn
        self.iteration = 0  # the iteration being run (the version this worker's sync sources send)
        self.finished = 0  # the last iteration run to its end (after a lost worker: kept or run again)
        # per sync edge into a hosted stage: the version it holds
        self.versions = {e.channel: 0 for e in workflow.edges_of("sync") if e.dst in self.stages}
        self._backlog: dict[str, dict[int, Any]] = {ch: {} for ch in self.versions}  # read, not applied
        self._applied: dict[str, Any] = {}  # per lagged edge, the state its target applied last

    # -- what runs when --------------------------------------------------------------------------

    def _inputs(self, name: str) -> list[Port]:
        wf = self.workflow
        edges = [wf.input_edge(name)] + [
            e for e in wf.edges if e.dst == name and e.kind in ("loop", "return")
        ]
        return [self.ports[e.channel] for e in edges if e is not None]

    def _output(self, name: str, kind: str = "stream") -> Port | None:
        e = next((e for e in self.workflow.edges if e.src == name and e.kind == kind), None)
        return self.ports[e.channel] if e is not None else None

    # -- guarded, timed calls ----------------------------------------------------------------------
    def _guard(self, stage: str, fn, *args):
        try:
            return fn(*args)
        except StageError:
            raise
        except (torch.OutOfMemoryError, MemoryError) as exc:
            said = str(exc).strip().splitlines()
            what = type(exc).__name__ + (f": {said[0]}" if said else "")
            line = f"stage {stage!r} ran out of memory on {self.ctx.device} (worker {self.name}; {what})"
            raise StageError(stage, self.name, traceback.format_exc(), "out_of_memory", line) from None
        except RunError as exc:
            raise StageError(stage, self.name, traceback.format_exc(), "stopped", str(exc)) from None
        except Exception:
            raise StageError(stage, self.name, traceback.format_exc()) from None

    def _timed(self, stage: str, kind: str, fn, *args, samples: int = 0):
        t0 = time.time()  # wall clock: comparable across processes (and, roughly, machines)
        out = self._guard(stage, fn, *args)
        if self.ctx.device.startswith("cuda"):
            # kernels run after the call returns: without this a span (and ``time/<stage>``, MFU)
            # would time the launches and charge the work to whichever stage synchronises next
            torch.cuda.synchronize(self.ctx.device)
        self.spans.append(Span(self.name, stage, kind, t0, time.time(), samples))
        return out

    def _switch(self, names: list[str], kind: str) -> None:
        if self.group.context_switch:
            for n in names:
                self._timed(n, kind, getattr(self.stages[n], kind))

    # -- commands (the same for every launcher) ----------------------------------------------------
    def handle(self, cmd: str, args: tuple = ()) -> Any:
        """Run one driver command: ``setup``, ``run_iteration``, ``call``, ``resync``, ``drain``,
        ``held_back``, ``finished``, ``shutdown``."""
        if cmd == "setup":
            return self.setup()
        if cmd == "finished":
            return self.finished
        if cmd == "run_iteration":
            return self.run_iteration(*args)
        if cmd == "call":
            stage, method, a, kw = args
            return self.call(stage, method, *a, **kw)
        if cmd == "resync":
            return self.resync(*args)
        if cmd == "drain":
            return self.drain(*args)
        if cmd == "held_back":
            return self.held_back(*args)
        if cmd == "shutdown":
            return self.teardown()
        raise ValueError(f"unknown worker command {cmd!r}")

    def setup(self) -> dict[str, Any]:
        import torch

        for name, st in self.stages.items():
            if name not in self._set_up:  # a restarted worker sets up again
                self._set_up.append(name)
            self._guard(name, st.setup, self.ctx)
        for name in self.stages:
            self._switch([name], "offload")
        self._holding = {t.slot for t in self.slot_turns if t.first}
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "cores": cores,
            "device": self.ctx.device,
        }

    def teardown(self) -> None:
        """The ``teardown`` of each stage whose setup began (one whose setup never ran, because an
        earlier one failed, holds nothing to release); errors are reported, not raised (the run
        is ending)."""
        for name in self._set_up:
            st = self.stages[name]
            try:
                st.teardown()
            except Exception:
                log.warning("teardown of stage %r on %s failed", name, self.name, exc_info=True)
        self.ctx.close()

    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        self._switch([stage], "onload")
        try:
            self._apply_pending([stage])
            return self._guard(stage, lambda: getattr(self.stages[stage], method)(*args, **kwargs))
        finally:
            self._switch([stage], "offload")

    # -- one iteration -------------------------------------------------------------------------------
    def run_iteration(
        self, iteration: int
    ) -> tuple[dict[str, tuple[Metrics | dict[str, float], int]], list[Span]]:
        """Returns ``({stage: (metrics, samples processed)}, spans)``."""
        self.iteration, self.ports = iteration, self.port_sets[iteration % len(self.port_sets)]
        for name, st in self.stages.items():
            self._guard(name, st.begin_iteration, iteration)
        self._runs = {n: _StageRun(self._inputs(n)) for n in self.stages}
        for i, turn in enumerate(self.turns):
            self._take_slots()
            self._switch(turn, "onload")
            self._apply_pending(turn)
            self._run_turn(turn)
            self._switch(turn, "offload")
            self._pass_slots(i)
        self._flush_broadcasts()
        self._receive_sync(iteration)
        results = {n: (r.metrics, r.samples) for n, r in self._runs.items()}
        spans, self.spans = self.spans, []
        self.finished = iteration
        return results, spans

    def _take_slots(self) -> None:
        """Wait for the baton of every shared slot this worker is on (its turn on them)."""
        for t in self.slot_turns:
            if t.slot not in self._holding:
                self._batons[t.slot].get()
                self._holding.add(t.slot)

    def _pass_slots(self, turn: int) -> None:
        """Hand each shared slot's baton to the worker whose turn on it comes next."""
        for t in self.slot_turns:
            self._holding.discard(t.slot)
            self._queues[t.passes_to[turn]].put(Message(None))

    def _apply_pending(self, names: list[str]) -> None:
        for n in names:
            if n in self._pending_sync:
                src, state = self._pending_sync.pop(n)
                self._timed(n, "apply_sync", self.stages[n].apply_sync, src, state)

    def _run_turn(self, turn: list[str]) -> None:
        pending = [n for n in reversed(turn)]  # downstream first: finish work before taking more
        idle_since, rotate = time.monotonic(), 0
        while pending:
            ports = [(n, p) for n in pending for p in self._runs[n].inputs]
            if len(ports) == 1:  # one input: block on it (with the channel's timeout)
                name, port = ports[0]
                self._handle(name, port, port.inbox.get())
            else:
                for name, port in ports:
                    got, item = port.inbox.poll()
                    if got:
                        self._handle(name, port, item)
                        idle_since = time.monotonic()
                        break
                else:
                    name, port = ports[rotate % len(ports)]
                    rotate += 1
                    got, item = port.inbox.poll(IDLE_SLICE_S)
                    if got:
                        self._handle(name, port, item)
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > self.timeout_s:
                        waiting = ", ".join(sorted({p.link.edge.channel for _, p in ports}))
                        raise ChannelTimeout(
                            f"worker {self.name!r} waited on channel(s) {waiting}: nothing arrived within "
                            f"{self.timeout_s:.0f} s (trainer.timeout_s); the stage feeding it is stuck "
                            "or too slow for this timeout"
                        )
            pending = [n for n in pending if not self._runs[n].done]

    def _handle(self, name: str, port: Port, item: Any) -> None:
        run = self._runs[name]
        edge = port.link.edge
        if isinstance(item, EndOfIteration):
            run.ends[edge.channel] = run.ends.get(edge.channel, 0) + 1
            self._maybe_finish(name)
            return
        msg: Message = item
        batch = msg.payload
        n = int(batch.batch_size[0]) if getattr(batch, "batch_dims", 0) else 0
        out = self._timed(name, "process", self.stages[name].process, batch, samples=n)
        run.samples += n
        lp = self.workflow.loop_of(name)
        if lp is not None and lp.head == name:
            turn = 1 if edge.kind == "stream" else msg.turn + 1
            run.in_flight += 1 if edge.kind == "stream" else 0
            if turn <= lp.turns:
                self._output(name, "loop").put(Message(out, msg.key, turn, self.replica))
                return
            run.in_flight -= 1
            self._emit(name, out, msg.key)
            self._maybe_finish(name)
        elif lp is not None:  # the body answers the head replica that asked
            if out is None:
                raise StageError(
                    name, self.name, f"loop body {name!r} returned None; it must answer the head"
                )
            self._output(name, "return").put(Message(out, msg.key, msg.turn, msg.origin))
        else:
            self._emit(name, out, msg.key)

    def _emit(self, name: str, out: Any, key: int) -> None:
        port = self._output(name)
        if out is not None and port is not None:
            port.put(Message(out, key))

    def _maybe_finish(self, name: str) -> None:
        run = self._runs[name]
        counted = [p for p in run.inputs if p.link.edge.kind != "return"]
        if run.in_flight or any(run.ends.get(p.link.edge.channel, 0) < p.link.ends_expected for p in counted):
            return
        st = self.stages[name]
        run.metrics = self._timed(name, "end_iteration", st.end_iteration) or {}
        for kind in ("stream", "loop"):
            port = self._output(name, kind)
            if port is not None:
                port.end()
        self._send_sync(name)
        run.done = True
