"""Workflow: the macro flow, a graph of stages joined by channels, and nothing about devices.

Three kinds of edges:

- **stream** edges carry micro-batches, in order of arrival, from one stage to the next; a stage
  reads at most one stream and writes at most one (``chain`` builds them);
- **sync** edges carry state once per iteration, after the source stage's last micro-batch (new
  weights from the actor to the rollout); each state is a *version* (version ``v`` is what the
  source held after iteration ``v``; version 0 the start). A sync edge with ``staleness`` k lets
  its target run k versions behind: after iteration ``i`` it applies version ``i - k``, so the
  rollout of iteration ``i + 1`` uses the weights of version ``i - k`` (asynchronous RL with bounded
  staleness; k = 0 is the synchronous flow);
- a **loop** is an edge pair between a *head* and a *body* stage that every micro-batch travels
  ``turns`` times per iteration before it leaves the head downstream (an env emits observations,
  the policy returns actions, the env steps; after ``turns`` steps the env emits the trajectory).

A workflow also names **roles**, so that the trainer drives any workflow without naming a stage:
``train`` (the stage that learns and is checkpointed) and ``evaluate`` (the stage that runs
held-out evaluation). Stages may declare the batch keys they read and write (``in_keys`` /
``out_keys``); :meth:`Workflow.check_keys` finds a key that nothing upstream produces.

The built-in flows are ``workflows.reasoning.reasoning_workflow`` (a chain of five stages and a
weight sync) and ``workflows.embodied.embodied_workflow`` (a loop between the env stage and the
rollout stage). A minimal one, runnable as it stands:

>>> class Double(Stage):
...     name, in_keys, out_keys = "double", ("x",), ("y",)
...     def process(self, batch):
...         batch["y"] = batch["x"] * 2
...         return batch
>>> class Learn(Stage):
...     name, in_keys = "learn", ("y",)
...     def process(self, batch):
...         return None  # a learning stage consumes its input
>>> wf = Workflow("toy").chain(Double(), Learn()).sync("learn", "double", "weights").role("train", "learn")
>>> wf.validate(); wf.check_keys(["x"]); wf.order
['double', 'learn']
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rlinf_lightning.flow.stage import Stage

SOURCE = "__input__"
EdgeKind = Literal["stream", "sync", "loop", "return"]
ROLES = ("train", "evaluate")


@dataclass(frozen=True)
class Edge:
    """``src`` feeds ``dst`` through channel ``channel``.

    ``kind``: ``stream`` (micro-batches), ``sync`` (state once per iteration), ``loop`` (head to
    body of a loop) or ``return`` (body back to the head). ``staleness``: how many versions a sync
    edge's target may lag behind its source (see the module docstring).
    """

    src: str
    dst: str
    channel: str
    kind: EdgeKind = "stream"
    staleness: int = 0


@dataclass(frozen=True)
class Loop:
    """Every micro-batch goes ``head -> body -> head`` ``turns`` times per iteration."""

    head: str
    body: str
    turns: int


class Workflow:
    """A graph of stages; see the module docstring for the edge kinds and roles."""

    def __init__(self, name: str, roles: dict[str, str] | None = None) -> None:
        self.name = name
        self.stages: dict[str, Stage] = {}
        self.edges: list[Edge] = []
        self.loops: list[Loop] = []
        self.roles: dict[str, str] = {}
        for role, stage in (roles or {}).items():
            self.role(role, stage)

    # -- building ----------------------------------------------------------------------------------
    def add(self, stage: Stage) -> Workflow:
        if stage.name in self.stages:
            raise ValueError(f"workflow {self.name!r} already has a stage named {stage.name!r}")
        self.stages[stage.name] = stage
        return self

    def chain(self, *stages: Stage) -> Workflow:
        """Add stages and stream each one's output into the next; the first reads the input."""
        prev = SOURCE
        for st in stages:
            self.add(st)
            self.connect(prev, st.name)
            prev = st.name
        return self

    def connect(self, src: str, dst: str) -> Workflow:
        """A stream edge ``src -> dst`` between stages already added (``SOURCE`` is the input)."""
        self._known(dst, *([] if src == SOURCE else [src]))
        if self.input_edge(dst) is not None:
            raise ValueError(f"stage {dst!r} already reads a stream; a stage reads at most one")
        if src != SOURCE and self.output_edge(src) is not None:
            raise ValueError(f"stage {src!r} already writes a stream; a stage writes at most one")
        self.edges.append(Edge(src, dst, f"{src}->{dst}"))
        return self

    def sync(self, src: str, dst: str, channel: str, staleness: int = 0) -> Workflow:
        """Hand ``src``'s :meth:`Stage.sync_state` to ``dst``'s :meth:`Stage.apply_sync` each
        iteration; ``dst`` may run up to ``staleness`` versions behind ``src``."""
        self._known(src, dst)
        if staleness < 0:
            raise ValueError(f"sync {src!r} -> {dst!r}: staleness must be >= 0, got {staleness}")
        self.edges.append(Edge(src, dst, channel, kind="sync", staleness=staleness))
        return self

    def loop(self, head: str, body: str, turns: int) -> Workflow:
        """Send each of ``head``'s outputs through ``body`` and back, ``turns`` times per iteration.

        The head is called once with each micro-batch from its stream input and once per turn with
        the body's answer; after the last turn its output goes down its stream output.
        """
        self._known(head, body)
        if turns < 1:
            raise ValueError(f"loop {head!r} <-> {body!r}: turns must be >= 1, got {turns}")
        for n in (head, body):
            if any(n in (lp.head, lp.body) for lp in self.loops):
                raise ValueError(f"stage {n!r} is already in a loop")
        if self.input_edge(body) is not None or self.output_edge(body) is not None:
            raise ValueError(f"loop body {body!r} must not read or write a stream; it answers the head")
        self.loops.append(Loop(head, body, turns))
        self.edges.append(Edge(head, body, f"{head}->{body}", kind="loop"))
        self.edges.append(Edge(body, head, f"{body}->{head}", kind="return"))
        return self

    def role(self, role: str, stage: str) -> Workflow:
        """Name the stage that plays ``role`` (one of :data:`ROLES`)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        self._known(stage)
        self.roles[role] = stage
        return self

    def _known(self, *names: str) -> None:
        for n in names:
            if n not in self.stages:
                raise ValueError(f"workflow {self.name!r} has no stage {n!r}; stages: {sorted(self.stages)}")

    # -- reading -----------------------------------------------------------------------------------
    def input_edge(self, stage: str) -> Edge | None:
        """The stream edge into ``stage`` (a loop body has none: it reads the loop edge)."""
        return next((e for e in self.edges if e.kind == "stream" and e.dst == stage), None)

    def output_edge(self, stage: str) -> Edge | None:
        return next((e for e in self.edges if e.kind == "stream" and e.src == stage), None)

    def edges_of(self, kind: EdgeKind) -> list[Edge]:
        return [e for e in self.edges if e.kind == kind]

    def loop_of(self, stage: str) -> Loop | None:
        return next((lp for lp in self.loops if stage in (lp.head, lp.body)), None)

    @property
    def max_staleness(self) -> int:
        """The largest lag any sync edge allows (0: every sync is synchronous)."""
        return max((e.staleness for e in self.edges_of("sync")), default=0)

    @property
    def in_flight(self) -> int:
        """How many iterations may be outstanding at once: the one finishing and the next (queued
        while it finishes), or, with a lagged sync, enough that the target of a sync lagging k
        versions never waits for its source (``k + 1``)."""
        return max(2, self.max_staleness + 1)

    @property
    def source_edge(self) -> Edge:
        return next(e for e in self.edges if e.kind == "stream" and e.src == SOURCE)

    @property
    def order(self) -> list[str]:
        """Stages in data order: each after everything that feeds it (a loop body after its head)."""
        feeds = {e.dst: e.src for e in self.edges if e.kind in ("stream", "loop")}
        out: list[str] = []

        def visit(n: str, path: tuple[str, ...]) -> None:
            if n in out:
                return
            if n in path:
                raise ValueError(f"workflow {self.name!r} has a stream cycle through {n!r}")
            src = feeds.get(n)
            if src is not None and src != SOURCE:
                visit(src, (*path, n))
            out.append(n)

        for n in self.stages:
            visit(n, ())
        for lp in self.loops:  # a loop's body right after its head (it works in the head's turn)
            out.remove(lp.body)
            out.insert(out.index(lp.head) + 1, lp.body)
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` unless one input feeds stages that every stage is reached from."""
        sources = [e for e in self.edges if e.kind == "stream" and e.src == SOURCE]
        if len(sources) != 1:
            raise ValueError(
                f"workflow {self.name!r} needs exactly one stage reading the input, got {len(sources)}"
            )
        order = self.order  # raises on cycles
        fed = {e.dst for e in self.edges if e.kind in ("stream", "loop")}
        orphans = [n for n in order if n not in fed]
        if orphans:
            raise ValueError(f"workflow {self.name!r}: stage(s) {orphans} read no stream and are in no loop")

    def check_keys(self, input_keys: Iterable[str]) -> None:
        """Raise naming a stage's ``in_keys`` entry that neither the input nor an upstream stage writes.

        Stages that declare no keys are not checked (and pass every key through).
        """
        have: dict[str, str] = {k: "the task's input" for k in input_keys}
        for name in self.order:
            st = self.stages[name]
            lp = self.loop_of(name)
            if lp is not None and lp.head == name:  # the body's answers reach the head too
                have.update({k: lp.body for k in self.stages[lp.body].out_keys})
            missing = [k for k in st.in_keys if k not in have]
            if missing:
                raise ValueError(
                    f"stage {name!r} reads {missing} but no stage before it writes "
                    f"{'it' if len(missing) == 1 else 'them'} (available: {sorted(have)})"
                )
            have.update({k: name for k in st.out_keys})
