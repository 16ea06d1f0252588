"""Worker restarts: a rollout worker SIGKILLed in the middle of a run is replaced and the run goes
on with the same updates as an uninterrupted one (beyond ``trainer.max_worker_restarts`` the run
ends as without restarts: ``tests/test_faults.py``)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rlinf_lightning import Callback, LMPolicy, RLTrainer
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow import ChannelTimeout
from rlinf_lightning.launchers import WorkerDied
from rlinf_lightning.launchers.base import noted
from rlinf_lightning.trainer.restarts import lost_workers
from trainer_defaults import MetricsRecorder, tiny_task, tiny_trainer_kwargs

KEYS = ("actor/loss", "actor/grad_norm", "workers/restarts")


class KillRollout(Callback):
    """Sends ``sig`` to the process of the worker of ``stage`` once, when iteration ``at`` ends: in
    queued mode iteration ``at + 1`` is running then (the rollout generating, or waiting for its
    weights). SIGKILL: it dies; SIGSTOP: it stops answering (and is killed by the restart)."""

    def __init__(self, at: int, sig: int = signal.SIGKILL, stage: str = "rollout") -> None:
        self.at, self.sig, self.stage, self.killed = at, sig, stage, False

    def on_iteration_end(self, trainer, iteration, metrics):
        if iteration == self.at and not self.killed:
            runtime = trainer.fit_loop.runtime
            os.kill(runtime.info[runtime.replicas_of(self.stage)[0]]["pid"], self.sig)
            self.killed = True


def _fit(assets, root, launcher: str, *callbacks, **over):
    steps = MetricsRecorder(keys=KEYS)
    kw = tiny_trainer_kwargs(
        root,
        devices=2,
        num_threads=1,
        strategy="disaggregated",  # the rollout's worker is not the actor's
        launcher=launcher,
        max_iterations=4,
        precision="32-true",
        callbacks=[steps, *callbacks],
        **over,
    )
    task = tiny_task(assets, format_reward="number_format", format_weight=1.0)
    summary = RLTrainer(**kw).fit(LMPolicy(str(assets["sft"]), lr=1e-3), task)
    return summary, steps.metrics


def test_restart_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"trainer.max_worker_restarts: must be >= 0, got -1"):
        RLTrainer(max_worker_restarts=-1).validate()


def test_the_lost_workers_are_the_dead_one_or_the_silent_ones():
    died = noted(WorkerDied("gen/0", ["rollout"], -9), ["train/0"], {})
    assert lost_workers(died) == ["gen/0"]  # the actor, still busy after the death, is not lost
    assert lost_workers(noted(ChannelTimeout("nothing arrived"), ["gen/0"], {})) == ["gen/0"]
    assert lost_workers(ChannelTimeout("no launcher noted it")) == []


# one case per launcher in the default run: ray's start-up is slow, the processes case is the same
# logic; a worker that stops answering (SIGSTOP, found by the actor's channel timeout) with `-m slow`
@pytest.mark.parametrize(
    "launcher, sig",
    [
        pytest.param("processes", signal.SIGKILL, id="processes-killed"),
        # 70 s in CI: Ray's restart path with `-m slow`; a Ray worker's failure stays in the default
        # run through test_faults' raising-worker case
        pytest.param("ray", signal.SIGKILL, id="ray-killed", marks=pytest.mark.slow),
        pytest.param("processes", signal.SIGSTOP, id="processes-stopped", marks=pytest.mark.slow),
    ],
)
def test_a_lost_rollout_worker_is_restarted_and_the_updates_are_unchanged(assets, tmp_path, launcher, sig):
    # the uninterrupted run on threads: every launcher computes the same updates (test_plans)
    want_summary, want = _fit(assets, tmp_path / "full", "inprocess")
    kill = KillRollout(at=1, sig=sig)
    # a stopped worker is found when the actor's wait for its samples runs out (trainer.timeout_s)
    timeout_s = 20 if sig == signal.SIGSTOP else 60
    summary, got = _fit(assets, tmp_path / "killed", launcher, kill, timeout_s=timeout_s)
    assert kill.killed
    assert want_summary["workers/restarts"] == 0 and summary["workers/restarts"] == 1
    on_disk = json.loads((tmp_path / "killed" / "run" / "summary.json").read_text())
    assert on_disk["workers/restarts"] == 1
    assert [m["workers/restarts"] for m in got][-1] == 1  # from the iteration the kill ended on
    assert len(got) == len(want) == 4
    for it, (g, w) in enumerate(zip(got, want), 1):
        for key in ("actor/loss", "actor/grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * max(1.0, abs(w[key])), (it, key, g[key], w[key])


# the actor's worker: a third processes run (the restart logic above, plus a resume) with `-m slow`
@pytest.mark.slow
def test_a_killed_actor_worker_goes_on_from_the_last_checkpoint_with_auto_resume(assets, tmp_path):
    """Checkpoints at 2 and 4; the actor's worker dies while iteration 4 runs (queued after 3):
    the run goes on from iteration 2's checkpoint, and iterations 3 and 4 (logged again) equal an
    uninterrupted run's."""
    _, want = _fit(assets, tmp_path / "full", "inprocess", ckpt_every=2)
    kill = KillRollout(at=3, stage="actor")
    summary, got = _fit(assets, tmp_path / "killed", "processes", kill, ckpt_every=2, auto_resume=True)
    assert kill.killed and summary["workers/restarts"] == 1
    assert len(got) == 5  # iterations 1, 2, 3, then 3 again from the checkpoint, and 4
    for it, g in zip((1, 2, 3, 3, 4), got):
        w = want[it - 1]
        for key in ("actor/loss", "actor/grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * max(1.0, abs(w[key])), (it, key, g[key], w[key])
