"""Seconds per step, stamped alike on both sides of a side-by-side benchmark (``vs_trl.py``,
``real_model.py``): at each optimizer step's end (TRL's ``on_step_end``, our ``on_iteration_end``),
the first step left out of ``s_per_step`` (warm-up: allocation, kernel selection)."""

from __future__ import annotations

from typing import Any


class StepClock:
    """Each step's start and end stamps (``time.perf_counter``) and, on our side, its metrics."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.stamps: list[float] = []
        self.metrics: list[dict] = []

    def s_per_step(self, fallback: float) -> float:
        """Seconds per step after the first; ``fallback`` (e.g. the whole run) with one step."""
        if len(self.stamps) < 2:
            return fallback
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)

    def s_per_step_with_first(self, t0: float | None = None) -> float:
        """Seconds per step from ``t0`` (default: the first step's start) to the last step's end."""
        start = self.starts[0] if t0 is None else t0
        return (self.stamps[-1] - start) / len(self.stamps)

    def steady_mean(self, key: str) -> float:
        """The mean of metric ``key`` over our steps after the first (all of them if only one)."""
        steady = self.metrics[1:] or self.metrics
        return sum(m.get(key, 0.0) for m in steady) / len(steady)

    def ours(self) -> Any:
        """A callback for our trainer that stamps each iteration's start and end (with its metrics)."""
        import time

        from rlinf_lightning import Callback

        clock = self

        class Stamp(Callback):
            def on_iteration_start(self, trainer, iteration):
                clock.starts.append(time.perf_counter())

            def on_iteration_end(self, trainer, iteration, metrics):
                clock.stamps.append(time.perf_counter())
                clock.metrics.append(dict(metrics))

        return Stamp()

    def trl(self) -> Any:
        """A ``transformers`` callback for TRL's trainer that stamps each optimizer step's end."""
        import time

        from transformers import TrainerCallback

        clock = self

        class Stamp(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.stamps.append(time.perf_counter())

        return Stamp()
