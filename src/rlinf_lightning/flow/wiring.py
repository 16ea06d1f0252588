"""Wiring: how each edge of a workflow connects the replicas of the groups a plan put it on.

Every launcher wires a plan the same way; only the queue transport differs. For an edge from a
stage on group A (or the driver's input) to a stage on group B:

- ``local``: A and B are the same group. Replica ``r``'s output stays on replica ``r`` through an
  in-process queue: a micro-batch runs through a collocated group without leaving its worker.
- ``shared``: one queue that every replica of B reads: each micro-batch goes to whichever replica
  asks first (pull), so one slow replica never stalls the others.
- ``keyed``: one queue per replica of B, chosen per message: by the message's ``key`` into a
  ``sticky`` stage or into the learning stage's group (its replicas are data-parallel ranks that
  step together, so each gets an equal share; pulled, one that asks first could take every
  micro-batch while the others idle), by its ``origin`` for a loop body's answer, by the receiving
  replica for a sync edge (each replica of B gets the state from replica ``b % |A|`` of A).

A sync edge between groups is ``broadcast`` when the plan's ``sync_transport`` says so (the
default on GPU): only the tensors' names and shapes go through the keyed queues, and A's first
replica broadcasts the tensors themselves over a process group of its own with B's replicas (NCCL
on GPU: GPU to GPU, never through the host).

End of iteration: each producer replica marks the end on every queue it may write; a consumer
replica is done with an edge when it has seen one mark per producer that writes its queue (for a
``shared`` queue a producer writes one mark per consumer, so every consumer gets its count).

Every cross-worker queue exists once per iteration that may be outstanding (``S`` =
``Workflow.in_flight``: 2, or ``k + 1`` with a sync lagging ``k`` versions): iteration ``i`` uses
set ``i % S``. So the driver can queue iterations ahead while ``i`` runs, and a replica that has
finished ``i`` and started a later one never takes a micro-batch or an end mark that a slower
replica still needs for ``i`` (no replica can be ``S`` iterations ahead: the driver starts
``i + S`` only after every worker finished ``i``). A sync edge's version ``v`` travels in set
``v % S``, where its target looks for it.

A lagged sync (``staleness`` > 0) never broadcasts: a broadcast holds the sender until its
receivers join, and a lagged receiver joins iterations later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlinf_lightning.flow.channel import Channel, EndOfIteration, Message
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.sharing import baton_queues
from rlinf_lightning.flow.workflow import SOURCE, Edge, Workflow

Mode = Literal["local", "shared", "keyed"]


@dataclass(frozen=True)
class Link:
    """One edge, wired: its mode and how many replicas write (``producers``) and read it."""

    edge: Edge
    mode: Mode
    producers: int
    consumers: int
    broadcast: bool = False  # a sync edge whose tensors go by broadcast (see the module docstring)
    sets: int = 2  # iterations that may be outstanding: one set of queues each

    def queue_names(self, parity: int | None = None) -> list[str]:
        """The names of the cross-worker queues a launcher creates for this link (none if local):
        of one set (``parity``: an iteration modulo :attr:`sets`), or of all sets when ``None``."""
        if parity is None:
            return [n for p in range(self.sets) for n in self.queue_names(p)]
        if self.mode == "shared":
            return [f"{self.edge.channel}@{parity}"]
        if self.mode == "keyed":
            return [f"{self.edge.channel}#{r}@{parity}" for r in range(self.consumers)]
        return []

    def reads(self, replica: int, parity: int) -> str | None:
        """The queue replica ``replica`` of the consumer reads (``None``: an in-process queue)."""
        if self.mode == "local":
            return None
        names = self.queue_names(parity)
        if self.mode == "shared":
            return names[0]
        # a producer's port asks too: a producer group may have more replicas than the consumer's
        return names[replica] if replica < len(names) else None

    @property
    def ends_expected(self) -> int:
        return 1 if self.mode == "local" else self.producers

    def sync_targets(self, replica: int) -> list[int]:
        """The consumer replicas that producer ``replica`` hands sync state to."""
        if self.mode == "local":
            return [replica]
        if self.broadcast:
            return list(range(self.consumers)) if replica == 0 else []
        return [b for b in range(self.consumers) if b % self.producers == replica]


def wire(workflow: Workflow, plan: ExecutionPlan) -> dict[str, Link]:
    """Channel name -> :class:`Link` for every edge of ``workflow`` under ``plan``."""
    links = {}
    train = workflow.roles.get("train")
    for e in workflow.edges:
        dst = plan.group_of(e.dst)
        learns = train in dst.stages
        src = None if e.src == SOURCE else plan.group_of(e.src)
        producers = 1 if src is None else src.replicas
        if src is dst:
            mode: Mode = "local"
        elif e.kind in ("return", "sync") or (
            e.kind == "stream" and (workflow.stages[e.dst].sticky or learns)
        ):
            mode = "keyed"
        else:
            mode = "shared"
        broadcast = e.kind == "sync" and mode == "keyed" and plan.broadcasts_sync and not e.staleness
        links[e.channel] = Link(e, mode, producers, dst.replicas, broadcast, workflow.in_flight)
    return links


def worker_queues(links: dict[str, Link], plan: ExecutionPlan, group: str) -> list[str]:
    """The cross-worker queues that a worker of ``group`` writes or reads (batons of shared slots
    included)."""
    names = baton_queues(plan, group)
    for link in links.values():
        e = link.edge
        touches = {plan.group_of(e.dst).name} | (set() if e.src == SOURCE else {plan.group_of(e.src).name})
        if group in touches:
            names.extend(link.queue_names())
    return names


class Port:
    """One worker's end of a link for one set of queues (``parity``: an iteration modulo
    ``link.sets``): what it reads, how it writes and marks the end."""

    def __init__(
        self, link: Link, queues: dict[str, Channel], replica: int, local: Channel | None, parity: int = 0
    ) -> None:
        self.link, self.replica = link, replica
        names = link.queue_names(parity)
        self._out = [local] if link.mode == "local" else [queues[n] for n in names if n in queues]
        self.inbox = local if link.mode == "local" else queues.get(link.reads(replica, parity) or "")

    @property
    def passes_objects(self) -> bool:
        """Whether what is put arrives as the same object (an in-process queue: no copy on the way)."""
        return all(q.transport == "object" for q in self._out)

    def put(self, msg: Message, target: int | None = None) -> None:
        if self.link.mode == "keyed":
            if target is None:
                target = msg.origin if self.link.edge.kind == "return" else msg.key
            self._out[target % self.link.consumers].put(msg)
        else:
            self._out[0].put(msg)

    def end(self) -> None:
        """Mark the end of this producer's iteration on every queue it writes."""
        copies = self.link.consumers if self.link.mode == "shared" else 1
        for q in self._out:
            for _ in range(copies):
                q.put(EndOfIteration())
