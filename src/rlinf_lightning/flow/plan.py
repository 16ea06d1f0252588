"""ExecutionPlan: where each stage runs and how big the micro-batches on each channel are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Schedule = Literal["sequential", "interleaved"]


@dataclass
class WorkerGroupSpec:
    """One worker process (or in-process worker) and the stages it hosts.

    ``schedule="sequential"`` runs its stages one after another, each to the end of the iteration,
    with ``onload``/``offload`` around each turn (context switching on a shared device);
    ``"interleaved"`` serves whichever hosted stage has input waiting, so micro-batches stream.
    """

    name: str
    stages: list[str]
    slots: list[int]
    schedule: Schedule = "sequential"
    context_switch: bool = False
    num_threads: int = 0

    def device(self) -> str:
        """The torch device of this worker: its first slot's GPU, or the CPU (slots are processes)."""
        import torch

        if torch.cuda.is_available():
            return f"cuda:{self.slots[0] % torch.cuda.device_count()}" if self.slots else "cuda"
        return "cpu"


@dataclass
class ExecutionPlan:
    strategy: str
    workers: list[WorkerGroupSpec]
    micro_batch_size: dict[str, int] = field(default_factory=dict)  # channel -> samples per message
    notes: str = ""

    def worker_of(self, stage: str) -> WorkerGroupSpec:
        for w in self.workers:
            if stage in w.stages:
                return w
        raise KeyError(f"stage {stage!r} is not placed by plan {self.strategy!r}")

    def validate(self, stage_names: list[str]) -> None:
        placed = [s for w in self.workers for s in w.stages]
        missing = sorted(set(stage_names) - set(placed))
        dup = sorted({s for s in placed if placed.count(s) > 1})
        if missing or dup:
            raise ValueError(f"plan {self.strategy!r}: unplaced stages {missing}, stages placed twice {dup}")

    def describe(self) -> str:
        """A table: one row per worker with its slots, stages and schedule, then channel granularity."""
        rows = [("worker", "slots", "stages", "schedule")]
        for w in self.workers:
            sched = w.schedule + (" +offload" if w.context_switch else "")
            rows.append((w.name, ",".join(map(str, w.slots)), " -> ".join(w.stages), sched))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"execution plan: {self.strategy}" + (f" ({self.notes})" if self.notes else "")]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(widths[j]) for j, c in enumerate(r)))
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        if self.micro_batch_size:
            mb = ", ".join(f"{c}: {n}" for c, n in self.micro_batch_size.items())
            lines.append(f"  micro-batch (samples): {mb}")
        return "\n".join(lines)
