"""Worker restarts: a worker lost in the middle of a run (killed, or silent past ``trainer.timeout_s``)
is replaced and the run goes on, up to ``trainer.max_worker_restarts`` times.

Only launchers whose workers are processes of their own (``processes``, ``ray``) can lose one
without losing the driver. The driver then starts the plan's workers afresh (a worker's channels,
process groups and turns on shared slots cannot be patched one worker at a time), so what the
lost worker held must be rebuilt:

* A worker of the rollout, env, reward or inference stages holds nothing the run needs back: the
  training state is read from the live actor (and critic), handed to the new workers, the weights
  re-synced, and the interrupted iterations run again from their inputs. Sampling draws from
  counters of the seed, iteration and sample, so they run again exactly.
* A worker of a learning stage (the actor, a critic) takes its optimizer state with it: the run
  goes on from the last checkpoint if ``trainer.auto_resume`` asks for it (:class:`Rewind`), else
  it ends as without restarts.

Beyond the bound, or under a lagged weight sync (``trainer.max_staleness``: the versions the
rollout held back die with it), the failure ends the run in its one line, as before.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_lightning.checkpoint import LAST
from rlinf_lightning.launchers import WorkerDied
from rlinf_lightning.workflows.training import TrainStage

if TYPE_CHECKING:
    from rlinf_lightning.trainer.fit_loop import FitLoop

log = logging.getLogger(__name__)

#: what a lost worker raises on the driver: its death, or a wait that ran out (``ChannelTimeout``
#: is a ``TimeoutError``)
LOST = (WorkerDied, TimeoutError)


class Rewind(Exception):
    """A learning stage's worker was lost: the fit goes on from the checkpoint ``resume`` (what
    ``FitLoop._read_checkpoint`` read), on new workers."""

    def __init__(self, resume: tuple[Path, Any, Any, Any, Any]) -> None:
        super().__init__(str(resume[0]))
        self.resume = resume


class WorkerRestarts:
    """Counts and performs the restarts of one fit (``workers/restarts`` in metrics and summary)."""

    def __init__(self, max_restarts: int, auto_resume: bool) -> None:
        self.max_restarts, self.auto_resume = max_restarts, auto_resume
        self.count = 0

    @property
    def metrics(self) -> dict[str, float]:
        return {"workers/restarts": float(self.count)}

    def recover(self, loop: FitLoop, exc: BaseException, it: int) -> bool:
        """After ``exc`` ended iteration ``it`` (``it - 1`` was the last one collected): replace
        the workers, and return whether the learning stages had made iteration ``it``'s update
        (the rollout waits for its weights, so it can die after the actor trained on it): the
        run then goes on with ``it + 1``, else with ``it`` again. Raise :class:`Rewind` to go on
        from the last checkpoint instead; re-raise ``exc`` where no restart applies."""
        runtime, workflow = loop.runtime, loop.workflow
        lost = lost_workers(exc)
        stages = {s for w in lost for s in runtime.stages_of.get(w, [])}
        learning = sorted(s for s in stages if isinstance(workflow.stages[s], TrainStage))
        why_not = self._why_not(loop, lost, learning)
        if why_not:
            log.info("no worker restart: %s", why_not)
            raise exc
        learning_all = [s for s, st in workflow.stages.items() if isinstance(st, TrainStage)]
        learners = sorted({w for s in learning_all for w in runtime.replicas_of(s)})
        runtime.abandon()
        trained = set() if learning else {f == it for f in runtime.finished(learners).values()}
        if len(trained) > 1:
            log.info("no worker restart: the learning stages' workers ended iteration %d apart", it)
            raise exc
        self.count += 1
        done = trained == {True}
        if learning:
            then = f"going on from {loop.trainer.ckpt_dir / LAST} (trainer.auto_resume)"
        else:
            then = f"iteration {it} {'was trained on; going on with the next' if done else 'runs again'}"
        log.warning(
            "%s; restarting the workers (restart %d of trainer.max_worker_restarts=%d), %s",
            str(exc).splitlines()[0], self.count, self.max_restarts, then,
        )  # fmt: skip
        if learning:
            resume = loop._read_checkpoint(LAST)
            runtime.shutdown()
            loop.runtime = loop._launch(loop.plan)
            raise Rewind(resume)
        loop._restart_workers(loop.plan, it if done else it - 1, lost=stages)
        return done

    def _why_not(self, loop: FitLoop, lost: list[str], learning: list[str]) -> str | None:
        if not lost:
            return "no worker was lost"
        if not loop._launcher(loop.plan).separate_processes:
            return "the workers are threads of the driver"
        if self.count >= self.max_restarts:
            return f"{self.count} restart(s) already, trainer.max_worker_restarts={self.max_restarts}"
        if loop.workflow.max_staleness:
            return "a lagged weight sync (trainer.max_staleness) held versions on the lost worker"
        if learning and not self.auto_resume:
            return f"worker(s) {lost} held the training state of {learning}; set trainer.auto_resume"
        if learning and not (loop.trainer.ckpt_dir / LAST).is_file():
            return f"worker(s) {lost} held the training state of {learning} and no checkpoint was written yet"
        return None


def lost_workers(exc: BaseException) -> list[str]:
    """The workers ``exc`` says were lost: the one that died; after a wait that ran out, those that
    had not answered when the driver stopped waiting (``launchers.base.with_silent``: a worker
    still busy in a long stage call after another died is not lost)."""
    if isinstance(exc, WorkerDied):
        return [exc.worker]
    return sorted(getattr(exc, "silent", []))
