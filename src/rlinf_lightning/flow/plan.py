"""ExecutionPlan: which worker group hosts each stage, on which slots, in how many replicas, and
how big the micro-batches on each channel are.

A *slot* is a GPU, or on CPU a core's worth of threads; slots are numbered node-major
(``slot = node * slots_per_node + local``). A :class:`WorkerGroup` spans some slots and has one
worker (a *replica*) per ``slots_per_replica`` of them; every stage of the group runs on every
replica, data-parallel: the channel into the group deals each micro-batch to the replica that asks
first. Groups may overlap: workers of different groups on one slot take turns on it
(``flow.sharing``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from rlinf_lightning.flow.budget import Budget
from rlinf_lightning.flow.sharing import shared_slots, sharing_problems, slot_order
from rlinf_lightning.flow.workflow import Workflow

Schedule = Literal["sequential", "interleaved"]


@dataclass
class WorkerGroup:
    """Stages that share workers.

    ``schedule="sequential"`` runs the stages one after another on each replica, each to the end
    of the iteration (a loop's head and body together), with ``onload``/``offload`` around each
    turn when ``context_switch`` is set; ``"interleaved"`` serves whichever hosted stage has input
    waiting, downstream first, so micro-batches stream through.
    """

    name: str
    stages: list[str]
    slots: list[int]
    slots_per_replica: int = 1
    schedule: Schedule = "sequential"
    context_switch: bool = False
    num_threads: int = 0  # torch intra-op threads per replica (CPU); 0: torch's default

    @property
    def replicas(self) -> int:
        return len(self.slots) // self.slots_per_replica

    def replica_slots(self, replica: int) -> list[int]:
        k = self.slots_per_replica
        return self.slots[replica * k : (replica + 1) * k]

    def worker_name(self, replica: int) -> str:
        return f"{self.name}/{replica}"


@dataclass
class ExecutionPlan:
    strategy: str
    groups: list[WorkerGroup]
    micro_batch_size: dict[str, int] = field(default_factory=dict)  # channel -> samples per message
    slots_per_node: int = 0  # 0: every slot on one node
    accelerator: str = "cpu"  # "cpu" or "cuda": what a slot is
    notes: str = ""
    # how sync state crosses between groups: "copy" (through the channel: shared memory, Ray's
    # object store), "broadcast" (a process group from the source's first replica; NCCL on GPU),
    # or "auto" (broadcast on GPU, copy on CPU)
    sync_transport: str = "auto"
    # the launcher this plan runs on (a name in ``LAUNCHERS``); None: ``trainer.launcher``. Set by
    # a strategy that weighs how workers start (auto runs a one-worker plan in the driver's process)
    launcher: str | None = None
    # the token budget (and activation checkpointing) each stage that sizes its own micro-batches
    # runs at: granularity, as micro_batch_size is; set when the plan is built
    # (``flow.memory.with_budgets``), put in force when its workers start
    budgets: dict[str, Budget] = field(default_factory=dict)

    @property
    def broadcasts_sync(self) -> bool:
        if self.sync_transport not in ("auto", "copy", "broadcast"):
            raise ValueError(f"sync_transport must be auto, copy or broadcast, got {self.sync_transport!r}")
        return self.sync_transport == "broadcast" or (
            self.sync_transport == "auto" and self.accelerator != "cpu"
        )

    def group_of(self, stage: str) -> WorkerGroup:
        for g in self.groups:
            if stage in g.stages:
                return g
        raise KeyError(f"stage {stage!r} is not placed by plan {self.strategy!r}")

    def node_of(self, slot: int) -> int:
        return slot // self.slots_per_node if self.slots_per_node else 0

    def device_of(self, slots: list[int], remapped: bool = False) -> str:
        """The torch device of a replica on ``slots``: the CPU, or its first slot's GPU on its node
        (``cuda:0`` when the launcher made only the replica's GPUs visible to it)."""
        if self.accelerator == "cpu":
            return "cpu"
        if remapped:
            return "cuda:0"
        return f"cuda:{slots[0] % self.slots_per_node if self.slots_per_node else slots[0]}"

    def visible_devices(self, slots: list[int]) -> str:
        """``CUDA_VISIBLE_DEVICES`` for a replica process on ``slots`` (node-local GPU indices)."""
        per = self.slots_per_node or (max(slots) + 1)
        return ",".join(str(s % per) for s in slots)

    def cores_of(self, slots: list[int]) -> set[int] | None:
        """The CPU cores a replica process on ``slots`` is pinned to: on CPU a slot is its share of
        the cores this process may run on (the node's cores split evenly between its slots, as
        ``Resources.threads`` splits the torch threads), so one slot on a 4-core node is all 4
        cores, not one core running 4 threads. ``None`` (no pinning) on GPUs, or where a node has
        fewer cores than the plan has slots on it.

        Pinning keeps what sizes its thread pool by the cores it may use (Mesa's llvmpipe renderer,
        OpenMP) on the replica's own cores instead of competing with the neighbouring replicas."""
        if self.accelerator != "cpu" or not hasattr(os, "sched_getaffinity"):
            return None
        cores = sorted(os.sched_getaffinity(0))
        per_node = self.slots_per_node or 1 + max(s for g in self.groups for s in g.slots)
        if per_node > len(cores):
            return None
        share = len(cores) // per_node
        return {c for s in slots for c in cores[(s % per_node) * share : (s % per_node + 1) * share]}

    def layout(self) -> tuple:
        """What decides the workers: two plans with the same layout run on the same workers (only
        their micro-batch sizes may differ); any other change starts new ones."""
        groups = tuple(
            (g.name, tuple(g.stages), tuple(g.slots), g.slots_per_replica, g.schedule, g.num_threads)
            for g in self.groups
        )
        return (self.launcher, groups)

    def rethreads(self, other: ExecutionPlan) -> bool:
        """Whether ``other`` runs this plan's single-worker groups on other CPU slots: only the
        thread counts differ, so one process can take it in place (``InProcessRuntime.adopt``)."""

        def shape(p: ExecutionPlan) -> list[tuple]:
            return [(g.name, tuple(g.stages), g.replicas, g.schedule, g.context_switch) for g in p.groups]

        single = all(g.replicas == 1 for g in other.groups)
        return shape(other) == shape(self) and other.accelerator == "cpu" and single

    @property
    def workers(self) -> list[tuple[WorkerGroup, int]]:
        """Every (group, replica) pair: one worker each."""
        return [(g, r) for g in self.groups for r in range(g.replicas)]

    def validate(self, workflow: Workflow, num_slots: int) -> None:
        """Raise ``ValueError`` naming the stage, slot or group that makes this plan impossible."""
        problems: list[str] = []
        placed = [s for g in self.groups for s in g.stages]
        for s in sorted(set(placed) - set(workflow.stages)):
            problems.append(
                f"stage {s!r} is not in workflow {workflow.name!r} (stages: {sorted(workflow.stages)})"
            )
        for s in sorted(set(workflow.stages) - set(placed)):
            problems.append(f"stage {s!r} is not placed on any slots")
        for s in sorted({s for s in placed if placed.count(s) > 1}):
            problems.append(f"stage {s!r} is placed in more than one group")
        names = [g.name for g in self.groups]
        for n in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"two groups are named {n!r}")
        for g in self.groups:
            if not g.slots:
                problems.append(f"group {g.name!r} ({', '.join(g.stages)}) has no slots")
                continue
            bad = sorted(s for s in g.slots if not 0 <= s < num_slots)
            if bad:
                problems.append(
                    f"group {g.name!r} ({', '.join(g.stages)}) uses slot(s) {bad}, but there are "
                    f"{num_slots} slots (0-{num_slots - 1}): raise trainer.devices or trainer.num_nodes"
                )
            if len(set(g.slots)) != len(g.slots):
                problems.append(f"group {g.name!r} lists a slot twice: {g.slots}")
            if g.slots_per_replica < 1 or len(g.slots) % g.slots_per_replica:
                problems.append(
                    f"group {g.name!r}: {len(g.slots)} slots do not split into replicas of "
                    f"{g.slots_per_replica} slot(s)"
                )
            elif self.slots_per_node:
                for r in range(g.replicas):
                    nodes = {self.node_of(s) for s in g.replica_slots(r)}
                    if len(nodes) > 1:
                        problems.append(
                            f"group {g.name!r}: replica {r} spans nodes {sorted(nodes)}; a replica's "
                            "slots must be on one node"
                        )
        if not problems:
            problems = sharing_problems(workflow, self)
        if problems:
            raise ValueError(f"plan {self.strategy!r}: " + "; ".join(problems))

    def describe(self, workflow: Workflow | None = None) -> str:
        """A table: one row per group (replicas, slots, threads, stages, schedule), then granularity,
        then (given the workflow) the order in which workers take turns on each shared slot."""
        rows = [("group", "replicas", "slots", "threads", "stages", "schedule")]
        multinode = any(self.node_of(s) for g in self.groups for s in g.slots)
        for g in self.groups:
            sched = g.schedule + (" +offload" if g.context_switch else "")
            slots = format_slots(g.slots)
            if multinode:
                nodes = sorted({self.node_of(s) for s in g.slots})
                slots += f" (node {','.join(map(str, nodes))})"
            per = f"x{g.slots_per_replica}" if g.slots_per_replica > 1 else ""
            threads = str(g.num_threads) if g.num_threads else "-"
            rows.append((g.name, f"{g.replicas}{per}", slots, threads, " -> ".join(g.stages), sched))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"execution plan: {self.strategy}" + (f" ({self.notes})" if self.notes else "")]
        if self.launcher:
            lines[0] += f", launcher {self.launcher}"
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(widths[j]) for j, c in enumerate(r)).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        if self.micro_batch_size:
            mb = ", ".join(f"{c}: {n}" for c, n in self.micro_batch_size.items())
            lines.append(f"  micro-batch (samples): {mb}")
        if self.budgets:
            chosen = ", ".join(
                f"{name}: {b.tokens:,}" + (" +checkpointing" if b.checkpointing else "")
                for name, b in sorted(self.budgets.items())
            )
            lines.append(f"  token budget (chosen): {chosen}")
        if workflow is not None:
            for slot, seq in slot_order(workflow, self).items():
                turns = " -> ".join(dict.fromkeys(f"{g}/{r}" for g, r, _ in seq))
                lines.append(f"  slot {slot} shared; its workers take turns each iteration: {turns}")
        else:
            for slot, workers in shared_slots(self).items():
                names = ", ".join(g.worker_name(r) for g, r in workers)
                lines.append(f"  slot {slot} shared; its workers take turns: {names}")
        return "\n".join(lines)


def format_slots(slots: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the placement syntax)."""
    out, run = [], []
    for s in sorted(slots):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
