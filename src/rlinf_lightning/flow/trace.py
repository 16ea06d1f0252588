"""Chrome trace-event JSON of a run's stage calls (open in https://ui.perfetto.dev).

One row per worker (a replica of a group), one complete ("X") event per stage call: each
micro-batch a stage processes, its end-of-iteration work, weight syncs and context switches.
Overlapping rows show the plan's pipelining, or its replicas working side by side; within one
row of a collocated plan the stages never overlap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlinf_lightning.flow.plan import ExecutionPlan


@dataclass
class Span:
    """One timed call: ``kind`` is ``process`` (a micro-batch), ``end_iteration``, ``sync_state``
    (gather and send state), ``sync_broadcast`` / ``sync_receive`` (the two ends of a broadcast
    sync), ``apply_sync``, ``onload`` or ``offload``."""

    worker: str
    stage: str
    kind: str
    start: float
    end: float
    samples: int = 0


def chrome_trace(spans: Iterable[Span], plan: ExecutionPlan) -> dict:
    spans = sorted(spans, key=lambda s: s.start)
    t0 = spans[0].start if spans else 0.0
    workers = [(g, r, g.worker_name(r)) for g, r in plan.workers]
    pid = {name: i for i, (_, _, name) in enumerate(workers)}
    events: list[dict] = []
    for g, r, name in workers:
        slots = ",".join(map(str, g.replica_slots(r)))
        label = f"{name} (slot {slots}: {', '.join(g.stages)})"
        events.append({"ph": "M", "name": "process_name", "pid": pid[name], "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid[name], "args": {"sort_index": pid[name]}}
        )
    for s in spans:
        events.append(
            {
                "ph": "X",
                "name": s.stage if s.kind == "process" else f"{s.stage}.{s.kind}",
                "cat": s.kind,
                "pid": pid.get(s.worker, len(pid)),
                "tid": 0,
                "ts": (s.start - t0) * 1e6,
                "dur": max(0.0, s.end - s.start) * 1e6,
                "args": {"samples": s.samples, "stage": s.stage},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"strategy": plan.strategy}}


def write_chrome_trace(path: str | os.PathLike, spans: Iterable[Span], plan: ExecutionPlan) -> Path:
    """Write atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(chrome_trace(spans, plan)))
    os.replace(tmp, path)
    return path
