"""Sync edges, the worker's side: state handed from a stage to the stages that mirror it (an
actor's weights into a rollout engine), each hand-off a version, the iteration after which it was
sent.

A source sends its state once its iteration's work is done: the object itself to a stage on the
same worker, a host copy through the channel to another worker, or by broadcast after the worker's
turns. A target applies the versions it is due after each iteration: exactly one on a synchronous
edge; on a lagged edge (``staleness`` k) only those it must take to stay within k versions.
:class:`SyncEdges` is :class:`~rlinf_lightning.flow.worker.Worker`'s base; it keeps what a
checkpoint needs to resume a lagging target exactly (:meth:`SyncEdges.held_back`,
:meth:`SyncEdges.resync`).
"""

from __future__ import annotations

import time
from typing import Any

from rlinf_lightning.flow.channel import Message
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.wiring import Port
from rlinf_lightning.flow.workflow import Workflow


class SyncEdges:
    """The sync-edge half of a worker. ``Worker.__init__`` sets up the state it shares with the
    rest of the worker (declared here) and its own: per sync edge into a hosted stage, the version
    it holds (``versions``), versions read but not applied (``_backlog``) and, on a lagged edge,
    the state applied last (``_applied``); broadcasts waiting for the end of the turns."""

    name: str
    replica: int
    iteration: int
    workflow: Workflow
    stages: dict[str, Stage]
    ctx: StageContext
    ports: dict[str, Port]
    port_sets: list[dict[str, Port]]
    spans: list[Span]
    slot_turns: list[Any]
    sync_meet: dict[str, Any]
    versions: dict[str, int]
    _backlog: dict[str, dict[int, Any]]
    _applied: dict[str, Any]
    _pending_sync: dict[str, tuple[str, Any]]
    _broadcasts: list[tuple[Port, Any]]
    _sync_groups: dict[str, Any]

    def _send_sync(self, name: str) -> None:
        """Hand ``name``'s sync state (version :attr:`iteration`) to its targets: the object itself
        to a stage on this worker; by broadcast (after this worker's turns, see ``flow.wiring``);
        else a host copy through the channel (a GPU tensor cannot cross to a worker that does not
        see its GPU; the receiving stage moves it onto its own device). A lagged edge's state is
        copied when the channel passes objects: the source keeps updating its weights in place
        while the version waits for its target."""
        for e in self.workflow.edges_of("sync"):
            if e.src == name:
                state = self._timed(name, "sync_state", self.stages[name].sync_state)
                port = self.ports[e.channel]
                targets = port.link.sync_targets(self.replica)
                if port.link.broadcast:
                    if targets:
                        self._broadcasts.append((port, state))
                    continue
                if targets and port.link.mode != "local" and state is not None and hasattr(state, "to"):
                    state = state.to("cpu")
                if targets and e.staleness and port.passes_objects and hasattr(state, "clone"):
                    state = state.clone()
                for target in targets:
                    port.put(Message(state, key=self.iteration), target=target)

    def _sync_group(self, port: Port) -> Any:
        """The process group of a broadcast sync edge: the source's replica 0 is rank 0, receiving
        replica ``b`` is rank ``1 + b``."""
        channel = port.link.edge.channel
        if channel not in self._sync_groups:
            from rlinf_lightning.flow.collective import private_group

            receiving = port.link.edge.dst in self.stages
            rank = 1 + self.replica if receiving else 0
            self._sync_groups[channel] = private_group(
                self.sync_meet[channel], rank, 1 + port.link.consumers, self.ctx.device, self.ctx.timeout_s
            )
        return self._sync_groups[channel]

    def _flush_broadcasts(self) -> None:
        from rlinf_lightning.flow.collective import broadcast_tensors

        for port, state in self._broadcasts:
            t0 = time.time()
            names = list(state.keys(include_nested=True, leaves_only=True))
            tensors = [state.get(k) for k in names]
            meta = [(k, tuple(t.shape), t.dtype) for k, t in zip(names, tensors)]
            for target in port.link.sync_targets(self.replica):
                port.put(Message(meta, key=self.iteration), target=target)
            broadcast_tensors(self._sync_group(port), tensors, meta, self.ctx.device)
            self.spans.append(Span(self.name, port.link.edge.src, "sync_broadcast", t0, time.time()))
        self._broadcasts = []

    def _receive_sync(self, iteration: int) -> None:
        """After ``iteration``: every sync edge into a hosted stage applies the versions it is due,
        up to ``iteration - staleness`` (exactly one, version ``iteration``, on a synchronous edge;
        none while a lagged edge is within its bound)."""
        for e in self._sync_into():
            while self.versions[e.channel] < iteration - e.staleness:
                self._apply_version(e, self.versions[e.channel] + 1)

    def _sync_into(self) -> list[Any]:
        return [e for e in self.workflow.edges_of("sync") if e.dst in self.stages]

    def _read_version(self, e: Any, version: int) -> Any:
        """Version ``version`` of sync edge ``e``: from the backlog, else from its queue set."""
        if version in self._backlog[e.channel]:
            return self._backlog[e.channel].pop(version)
        from tensordict import TensorDict

        from rlinf_lightning.flow.collective import broadcast_tensors

        port = self.port_sets[version % len(self.port_sets)][e.channel]
        msg = port.inbox.get()
        if msg.key != version:
            raise RuntimeError(f"sync {e.channel!r}: expected version {version}, got {msg.key}")
        state = msg.payload
        if port.link.broadcast:  # the names and shapes came; the tensors come by broadcast
            t0, meta = time.time(), state
            tensors = broadcast_tensors(self._sync_group(port), None, meta, self.ctx.device)
            state = TensorDict({}, batch_size=[])
            for (name, _, _), t in zip(meta, tensors):
                state.set(name, t)
            self.spans.append(Span(self.name, e.dst, "sync_receive", t0, time.time()))
        return state

    def _apply_version(self, e: Any, version: int, state: Any = None) -> None:
        """Apply version ``version`` of sync edge ``e`` (``state``, else read it)."""
        state = self._read_version(e, version) if state is None else state
        stage = self.stages[e.dst]
        if self.slot_turns:  # on a shared slot: applied in the stage's next turn (or call)
            self._pending_sync[e.dst] = (e.src, state)
        else:
            self._switch([e.dst], "onload")
            self._timed(e.dst, "apply_sync", stage.apply_sync, e.src, state)
            self._switch([e.dst], "offload")
        stage.policy_version = self.versions[e.channel] = version
        if e.staleness:  # what a checkpoint saves of a lagging target (see held_back)
            self._applied[e.channel] = state

    def drain(self, version: int) -> None:
        """Apply every version up to ``version`` that a lagged sync edge still holds back (the
        driver asks when the workers are idle after iteration ``version``, before an evaluation
        or the end, so they evaluate the newest weights)."""
        for e in self._sync_into():
            while self.versions[e.channel] < version:
                self._apply_version(e, self.versions[e.channel] + 1)

    def held_back(self, version: int) -> dict[str, list[tuple[int, Any]]]:
        """Per lagged sync edge into a hosted stage, idle after iteration ``version``: the version
        its target holds and those it has not applied yet, below ``version`` (the source sends
        ``version`` itself again when resumed), each ``(version, state)`` (``None``: the initial
        weights, never synced). What a checkpoint saves so that a resumed run lags exactly as the
        uninterrupted one; the versions stay where they were, for this run to go on."""
        out = {}
        for e in self._sync_into():
            if e.staleness:
                held = self.versions[e.channel]
                for v in range(held + 1, version + 1):  # into the backlog, out of the queues
                    self._backlog[e.channel][v] = self._read_version(e, v)
                out[e.channel] = [(held, self._applied.get(e.channel))] + [
                    (v, self._backlog[e.channel][v]) for v in range(held + 1, version)
                ]
        return out

    def resync(self, version: int = 0, held_back: dict[str, list[tuple[int, Any]]] | None = None) -> None:
        """Every sync edge once, outside an iteration, as version ``version`` (after restoring the
        checkpoint of iteration ``version``, or moving to new workers; every worker is idle). A
        lagged edge whose checkpoint saved what its target held back (:meth:`held_back`) takes
        those versions again instead (then as many more as its bound requires)."""
        self.iteration, self.ports = version, self.port_sets[version % len(self.port_sets)]
        for name in self.stages:
            self._switch([name], "onload")
            self._send_sync(name)
            self._switch([name], "offload")
        self._flush_broadcasts()
        for e in self._sync_into():
            saved = (held_back or {}).get(e.channel)
            if not saved:
                self._apply_version(e, version)
                continue
            (held, state), *later = saved
            if state is not None:
                self._apply_version(e, held, state)
            self.stages[e.dst].policy_version = self.versions[e.channel] = held
            self._backlog[e.channel].update(dict(later))
            self._backlog[e.channel][version] = self._read_version(e, version)
        self._receive_sync(version)
