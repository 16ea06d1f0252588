"""Profile: what each stage costs, measured from a run's own spans, fitted as a function of the
plan's granularity, and saved as JSON for reuse (``rlinf plan``, ``AutoStrategy(profile=...)``).

Every number comes from real calls on one slot of this machine (on CPU one core, one torch
thread): a stage's ``process`` calls at each micro-batch size the profiling iterations used, its
``end_iteration`` (for the learning stage: the optimizer step and the gradient all-reduce), the
sync edges' two ends, and the part of an iteration no span covers (the driver's feeding and
collecting, messages between processes), which the simulator adds as a constant.

A stage's time per call is fitted as ``a + b x micro_batch`` (least squares through the median
call at each measured size, both >= 0): ``a`` is what a call costs however small (Python, kernel
launches, a simulator's step), ``b`` what each sample adds. The median per size, because the
noise is one-sided (a collection pause, another process taking the core): one slow call among
three must not move the line. With one measured size the fit is proportional (``a = 0``), which
is exact at that size and optimistic for smaller ones; the search then stays at measured sizes.

A replica spanning ``n`` slots (on CPU, one worker with ``n`` torch threads) is predicted from
the one-slot costs divided by each stage's measured ``speedup[n]``: one iteration of such a
worker, timed per stage, over the one-slot fit at its size. Widths never measured are not
predicted.

A stage measured on another cluster at several device counts (``rlinf plan --profile curves.yaml``,
``auto.curves``) also carries ``replica_cost``: how much more each of its calls costs in a group of
``d`` data-parallel replicas than ``d`` perfectly scaling ones would (its all-reduce, stragglers),
interpolated between the counts measured and extrapolated past them along the last two.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlinf_lightning.flow.trace import Span

PROFILE_VERSION = 2
MIN_TIMED_S = 1e-4  # a call shorter than this is timing noise, not a speed to compare


@dataclass
class StageCost:
    """One stage on one slot: per-call seconds ``a + b x micro_batch``, end-of-iteration seconds."""

    a: float = 0.0
    b: float = 0.0
    end_s: float = 0.0
    sizes: list[int] = field(default_factory=list)  # the micro-batch sizes the fit saw

    def call_s(self, micro_batch: int) -> float:
        return self.a + self.b * micro_batch

    @classmethod
    def fit(cls, points: list[tuple[int, float]], end_s: float = 0.0) -> StageCost:
        """Least squares through the median of each size's ``(micro_batch, seconds)`` points,
        clamped to ``a, b >= 0``."""
        sizes = sorted({n for n, _ in points})
        if not points:
            return cls(end_s=end_s)
        ys = [statistics.median(t for m, t in points if m == n) for n in sizes]
        if len(sizes) == 1:
            return cls(0.0, ys[0] / max(sizes[0], 1), end_s, sizes)
        xs = [float(n) for n in sizes]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        if b < 0:
            a, b = my, 0.0
        elif a < 0:
            a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return cls(a, b, end_s, sizes)


@dataclass
class Profile:
    """Per-stage costs of one workflow on one slot, plus what the simulator needs besides.

    Attributes:
        workflow: the workflow's name (a profile is reused only for the workflow it measured).
        stages: stage name -> its :class:`StageCost`.
        sync_s: per stage at either end of a sync edge, seconds of its side of the sync.
        overhead_s: seconds per iteration outside every stage call (driver, messages).
        message_s: seconds a message costs when it crosses between workers.
        launch_s: seconds from launching the trainer's launcher's workers to their first iteration
            (what a change to a plan on them costs: the workers are started anew); measured, or
            estimated while ``launch_estimated`` (see ``auto.launch``).
        launch_estimated: ``launch_s`` is an estimate (no such worker started on the run yet).
        inprocess_launch_s: the same for a worker in the driver's process (measured).
        speedup: per replica width ``n`` (slots, as text), per stage, how many times faster a
            replica of ``n`` slots ran than one slot (measured; see the module docstring).
        accelerator: what one slot was (``cpu``: a core, one torch thread; ``cuda``: a GPU).
        points: per stage, the ``(micro_batch, seconds)`` calls behind its fit.
        end_samples, sync_samples: per stage, the measured end-of-iteration and sync seconds.
        first_end_s: per stage, the end-of-iteration seconds of the first iteration on one slot:
            its set-up is in them, so they stay out of the fit; a wide replica's speed-up is
            measured against them where no later one-slot iteration timed the stage's end.
        replica_cost: per stage, per data-parallel replica count (as text), the factor on its
            per-call and end-of-iteration seconds (cost curves only; see the module docstring).
    """

    workflow: str
    stages: dict[str, StageCost] = field(default_factory=dict)
    sync_s: dict[str, float] = field(default_factory=dict)
    overhead_s: float = 0.0
    message_s: float = 0.0005
    launch_s: float = 0.0
    launch_estimated: bool = False
    inprocess_launch_s: float = 0.0
    speedup: dict[str, dict[str, float]] = field(default_factory=dict)
    accelerator: str = "cpu"
    points: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    end_samples: dict[str, list[float]] = field(default_factory=dict)
    sync_samples: dict[str, list[float]] = field(default_factory=dict)
    replica_cost: dict[str, dict[str, float]] = field(default_factory=dict)
    first_end_s: dict[str, float] = field(default_factory=dict)

    # -- from spans ----------------------------------------------------------------------------------
    def add_spans(
        self,
        spans: Iterable[Span],
        micro_batch: int,
        skip_first: bool = False,
        widths: dict[str, int] | None = None,
        per_sample_ends: Collection[str] = (),
    ) -> None:
        """Record one iteration's ``process`` calls at source granularity ``micro_batch``, and its
        end-of-iteration and sync costs. ``skip_first`` drops each worker's first call of each
        stage (the first iteration's one-off set-up: lazy imports, caches, allocator growth) and
        the iteration's end-of-iteration and sync costs. ``widths``: the slots per replica of each
        stage, when not one: its calls and end-of-iteration seconds are taken back to one slot by the
        measured speed-up. ``per_sample_ends``: stages whose end of iteration works on the samples
        a replica received (``Stage.end_per_sample``): a replica's is taken back to the whole
        iteration's samples by its share of the stage's calls, as one worker measures it."""
        spans = sorted(spans, key=lambda s: s.start)
        calls: dict[tuple[str, str], int] = {}
        for s in spans:
            if s.kind == "process" and s.stage in per_sample_ends:
                calls[(s.worker, s.stage)] = calls.get((s.worker, s.stage), 0) + 1
        seen: set[tuple[str, str]] = set()
        ends: dict[str, list[float]] = {}
        sync: dict[str, float] = {}
        for s in spans:
            d = s.end - s.start
            if s.kind in ("process", "end_iteration"):  # what the simulator speeds up over slots
                d *= self.factor(s.stage, (widths or {}).get(s.stage, 1))
            if s.kind == "process":
                if skip_first and (s.worker, s.stage) not in seen:
                    seen.add((s.worker, s.stage))
                    continue
                self.points.setdefault(s.stage, []).append((micro_batch, d))
            elif s.kind == "end_iteration":
                if (s.worker, s.stage) in calls:
                    d *= sum(n for (_, st), n in calls.items() if st == s.stage) / calls[(s.worker, s.stage)]
                ends.setdefault(s.stage, []).append(d)
            elif s.kind in ("sync_state", "apply_sync", "sync_broadcast", "sync_receive"):
                sync[s.stage] = max(sync.get(s.stage, 0.0), d)
        if skip_first:  # the first step also builds optimizer state, measures the peak, ...
            self.first_end_s.update({stage: min(ds) for stage, ds in ends.items()})
            return
        for stage, ds in ends.items():
            # replicas of a collective step wait for the slowest; the last to arrive waited least
            self.end_samples.setdefault(stage, []).append(min(ds))
        for stage, d in sync.items():
            self.sync_samples.setdefault(stage, []).append(d)

    def add_speedup(self, width: int, spans: Iterable[Span], micro_batch: int) -> None:
        """Record how much faster each stage's work in an iteration ran on a replica of ``width``
        slots (``spans``: one iteration at ``micro_batch``) than one slot's: its calls (each at
        their median) against the fit at that size, plus its end of iteration against the one-slot
        one (the fit's, else the first iteration's). At that size the wide replica's prediction is
        then what it measured, wherever the size is on the fit. The end counts: an embodied actor
        buffers in its calls and trains at the end, and its calls alone would say 1 (too short to
        time, under ``MIN_TIMED_S``, is taken as 1)."""
        calls: dict[str, list[float]] = {}
        ends: dict[str, float] = {}
        for s in spans:
            if s.kind == "process":
                calls.setdefault(s.stage, []).append(s.end - s.start)
            elif s.kind == "end_iteration":  # replicas of a collective: the last to arrive waited least
                ends[s.stage] = min(ends.get(s.stage, math.inf), s.end - s.start)
        factors = {}
        for stage in calls.keys() | ends.keys():
            ds, cost = calls.get(stage, []), self.stages.get(stage, StageCost())
            one_end = cost.end_s or self.first_end_s.get(stage, 0.0)  # 0: never timed on one slot
            timed_end = stage in ends and one_end > 0
            wide = len(ds) * (statistics.median(ds) if ds else 0.0) + (ends[stage] if timed_end else 0.0)
            one = len(ds) * cost.call_s(micro_batch) + (one_end if timed_end else 0.0)
            factors[stage] = one / wide if min(one, wide) >= MIN_TIMED_S else 1.0
        self.speedup[str(width)] = factors

    def factor(self, stage: str, width: int) -> float:
        """How many times faster ``stage`` runs on ``width`` slots than on one (``KeyError``: the
        width was never measured)."""
        return 1.0 if width == 1 else self.speedup[str(width)].get(stage, 1.0)

    def replicas_factor(self, stage: str, replicas: int) -> float:
        """The factor on ``stage``'s seconds in a group of ``replicas`` data-parallel replicas:
        1 without a measured curve; else piecewise linear in log(replicas) through the measured
        counts, and past them along the nearest two (at least 0.01)."""
        curve = self.replica_cost.get(stage)
        if not curve:
            return 1.0
        pts = sorted((math.log(int(d)), f) for d, f in curve.items())
        if len(pts) == 1:
            return pts[0][1]
        x = math.log(replicas)
        i = next((i for i in range(1, len(pts) - 1) if x < pts[i][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(0.01, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def refit(self) -> None:
        """Fit every stage from its points, end-of-iteration and sync samples."""
        for stage, pts in self.points.items():
            end = statistics.median(self.end_samples[stage]) if self.end_samples.get(stage) else 0.0
            self.stages[stage] = StageCost.fit(pts, end)
        for stage, ds in self.end_samples.items():
            if stage not in self.stages:
                self.stages[stage] = StageCost(end_s=statistics.median(ds))
        self.sync_s = {stage: statistics.median(ds) for stage, ds in self.sync_samples.items()}

    def shifted(self, recent: Profile) -> Profile:
        """A copy whose stages keep their per-sample slope but take their per-call constant, end
        of iteration and sync costs from ``recent`` (a profile of the last iterations, at one
        granularity): the best guess one size allows after a drift, refined once a second size
        has run."""
        out = Profile.from_dict(self.to_dict())
        for stage, pts in recent.points.items():
            old = out.stages.get(stage, StageCost())
            ends = recent.end_samples.get(stage)
            end = statistics.median(ends) if ends else old.end_s
            a = statistics.fmean(t - old.b * n for n, t in pts)
            if a >= 0:
                out.stages[stage] = StageCost(a, old.b, end, sorted({n for n, _ in pts}))
            else:  # cheaper per sample than before: proportional at the new size
                out.stages[stage] = StageCost.fit(pts, end)
        for stage, ds in recent.sync_samples.items():
            out.sync_s[stage] = statistics.median(ds)
        return out

    def scaled(self, speed: float | dict[str, float]) -> Profile:
        """A copy for devices ``speed`` times as fast as the profiled slot (one factor, or one per
        stage, default 1): every stage's call, end-of-iteration and sync seconds divided by it."""
        out = Profile.from_dict(self.to_dict())

        def factor(stage: str) -> float:
            f = speed.get(stage, 1.0) if isinstance(speed, dict) else speed
            if f <= 0:
                raise ValueError(f"speed-up for {stage!r} must be > 0, got {f}")
            return float(f)

        for stage, c in out.stages.items():
            f = factor(stage)
            out.stages[stage] = StageCost(c.a / f, c.b / f, c.end_s / f, list(c.sizes))
        out.sync_s = {stage: t / factor(stage) for stage, t in out.sync_s.items()}
        return out

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}; this library reads {PROFILE_VERSION}")
        return cls(
            workflow=d["workflow"],
            stages={k: StageCost(**v) for k, v in d["stages"].items()},
            sync_s=dict(d["sync_s"]),
            overhead_s=d["overhead_s"],
            message_s=d["message_s"],
            launch_s=d["launch_s"],
            launch_estimated=d["launch_estimated"],
            inprocess_launch_s=d["inprocess_launch_s"],
            speedup={w: dict(f) for w, f in d["speedup"].items()},
            accelerator=d["accelerator"],
            points={k: [(int(n), float(t)) for n, t in v] for k, v in d["points"].items()},
            end_samples={k: list(v) for k, v in d["end_samples"].items()},
            sync_samples={k: list(v) for k, v in d["sync_samples"].items()},
            replica_cost={k: dict(v) for k, v in d.get("replica_cost", {}).items()},
            first_end_s=dict(d.get("first_end_s", {})),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a readable profile ({type(exc).__name__}: {exc})") from None
