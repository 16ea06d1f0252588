"""Workflow: the macro flow, stages and the channels between them, and nothing about devices."""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_lightning.flow.stage import Stage

SOURCE = "__input__"


@dataclass(frozen=True)
class Edge:
    """``src`` feeds ``dst`` through channel ``channel``; ``sync`` edges carry state once per iteration."""

    src: str
    dst: str
    channel: str
    sync: bool = False


class Workflow:
    """A graph of stages. Stream edges form a chain from the source; sync edges may point back.

    >>> wf = Workflow("math").chain(rollout, reward, actor).sync("actor", "rollout", "weights")
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.stages: dict[str, Stage] = {}
        self.edges: list[Edge] = []

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
            self.edges.append(Edge(prev, st.name, f"{prev}->{st.name}"))
            prev = st.name
        return self

    def sync(self, src: str, dst: str, channel: str) -> Workflow:
        for n in (src, dst):
            if n not in self.stages:
                raise ValueError(f"sync edge names unknown stage {n!r}")
        self.edges.append(Edge(src, dst, channel, sync=True))
        return self

    @property
    def order(self) -> list[str]:
        """Stage names in stream order (source first)."""
        order, cur = [], SOURCE
        nxt = {e.src: e.dst for e in self.edges if not e.sync}
        while cur in nxt:
            cur = nxt[cur]
            order.append(cur)
        return order

    def input_edge(self, stage: str) -> Edge:
        return next(e for e in self.edges if not e.sync and e.dst == stage)

    def output_edge(self, stage: str) -> Edge | None:
        return next((e for e in self.edges if not e.sync and e.src == stage), None)

    def sync_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.sync]
