"""Lightning-style callbacks: hooks named as in Lightning, called by :class:`RLTrainer`."""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinf_lightning.trainer import RLTrainer

log = logging.getLogger(__name__)


class Callback:
    """Override any hook. ``metrics`` are flat ``{"stage/name": value}`` dicts as logged. During a
    fit, ``trainer.policy`` and ``trainer.task`` are what is being fit."""

    def on_fit_start(self, trainer: RLTrainer, policy: Any) -> None:
        """The workers run (and a resumed run's state is loaded); the first evaluation follows."""

    def on_iteration_start(self, trainer: RLTrainer, iteration: int) -> None:
        """Called in order before ``on_iteration_end`` of the same iteration. The workers may
        already be running it: the trainer queues each iteration while the previous one runs
        (unless evaluation or a checkpoint comes between), so the workers go straight on and the
        driver logs meanwhile."""

    def on_iteration_end(self, trainer: RLTrainer, iteration: int, metrics: dict[str, float]) -> None:
        """Iteration ``iteration`` ended; ``metrics`` are what the loggers received for it."""

    def on_evaluation_end(self, trainer: RLTrainer, iteration: int, metrics: dict[str, float]) -> None:
        """A held-out evaluation after ``iteration`` iterations (0: before training) returned
        ``metrics`` (the task's ``evaluate``); the headline is ``metrics[trainer.task.eval_metric]``."""

    def on_save_checkpoint(self, trainer: RLTrainer, path: str) -> None:
        """A checkpoint was written (atomically) to ``path``."""

    def on_fit_end(self, trainer: RLTrainer, summary: dict[str, Any]) -> None:
        """The fit finished; ``summary`` is what ``summary.json`` holds."""

    def on_exception(self, trainer: RLTrainer, exception: BaseException) -> None:
        """The fit is failing with ``exception`` (the workers are shut down after this hook)."""


def _clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) for a progress line."""
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar(Callback):
    """One live line per iteration: the headline metrics, seconds per stage, throughput, and the
    estimated time to the last iteration (evaluation and checkpoint pauses included, as measured).

    Uses ``rich`` for colour on a terminal and plain text elsewhere (CI logs, files). The lines are
    the run's report on stdout, not log records, but they show only while this module's logger is
    enabled for INFO: ``rlinf --quiet`` hides them with the INFO records (see ``console``).
    """

    def __init__(self, refresh_every: int = 1) -> None:
        self.refresh_every = max(1, refresh_every)

    def on_fit_start(self, trainer, policy) -> None:
        from rich.console import Console

        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.t0 = time.perf_counter()

    def on_iteration_end(self, trainer, iteration, metrics) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        if iteration % self.refresh_every and iteration != trainer.max_iterations:
            return
        stage_s = " ".join(
            f"{k.split('/')[1]} {v:.2f}s"
            for k, v in metrics.items()
            if k.startswith("time/") and k != "time/iteration"
        )
        headline = getattr(trainer.task, "headline", {})  # the task says what matters on the line
        head = "".join(
            f"  {name} [green]{metrics[k]:.3f}[/green]" for k, name in headline.items() if k in metrics
        )
        if not hasattr(self, "first"):  # iterations timed from the first one this fit ran (resume)
            self.first, self.t_first = iteration, time.perf_counter() - metrics.get("time/iteration", 0.0)
        done = iteration - self.first + 1
        eta = (time.perf_counter() - self.t_first) / done * (trainer.max_iterations - iteration)
        self.console.print(
            f"[bold]it {iteration:>4}/{trainer.max_iterations}[/bold]{head}"
            f"  | {stage_s} | {metrics.get('perf/samples_per_s', 0):.0f} samples/s | ETA {_clock(eta)}"
        )

    def on_evaluation_end(self, trainer, iteration, metrics) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        head = trainer.task.eval_metric
        self.console.print(f"[cyan]eval @ it {iteration}: held-out {head} {metrics[head]:.3f}[/cyan]")
