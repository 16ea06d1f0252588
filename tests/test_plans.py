"""Execution plans: the same workflow under every strategy and launcher computes the same update."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import LMPolicy, RLTrainer
from rlinf_lightning.flow import Stage, Workflow
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.launchers import LAUNCHERS, WorkerDied
from rlinf_lightning.strategies import STRATEGIES, BatchShape, Resources
from rlinf_lightning.tasks.math import MathTask
from trainer_defaults import cli_fit_args, tiny_trainer_kwargs

LAUNCHER_NAMES = ["inprocess", "processes", "ray"]


def _fit(assets, root, **over):
    kw = tiny_trainer_kwargs(root, **{"max_iterations": 1, "devices": 2, "num_threads": 1, **over})
    trainer = RLTrainer(**kw)
    summary = trainer.fit(
        LMPolicy(str(assets["sft"]), lr=1e-3),
        MathTask(str(assets["train"]), str(assets["test"]), eval_size=8),
    )
    last = (root / "run" / "checkpoints" / "last").read_text()
    weights = load_file(str(root / "run" / "checkpoints" / last / "model.safetensors"))
    return trainer, summary, weights


@pytest.mark.parametrize("launcher", LAUNCHER_NAMES)
def test_one_iteration_is_the_same_update_under_every_strategy(assets, tmp_path, launcher):
    base = load_file(str(assets["sft"] / "model.safetensors"))
    results = {}
    for strategy in ("collocated", "disaggregated", "hybrid"):
        trainer, _, results[strategy] = _fit(
            assets, tmp_path / strategy, strategy=strategy, launcher=launcher
        )
        assert trainer.plan.strategy == strategy
    ref = results["collocated"]
    assert max(float((ref[k] - base[k]).abs().max()) for k in ref if k in base) > 1e-4  # it did learn
    for strategy in ("disaggregated", "hybrid"):
        diff = max(float((results[strategy][k] - ref[k]).abs().max()) for k in ref)
        assert diff <= 1e-4, (strategy, launcher, diff)


def test_plans_place_stages_as_documented():
    from rlinf_lightning.workflows.reasoning import reasoning_workflow  # noqa: F401  (stage names below)

    wf = Workflow("w").chain(*[_Named(n) for n in ("rollout", "reward", "advantage", "inference", "actor")])
    res, batch = Resources(devices=2, threads_per_slot=1), BatchShape(128, 8)
    col = STRATEGIES.resolve("collocated").plan(wf, res, batch)
    dis = STRATEGIES.resolve("disaggregated").plan(wf, res, batch)
    hyb = STRATEGIES.resolve("hybrid").plan(wf, res, batch)
    assert [w.stages for w in col.workers] == [wf.order] and col.workers[0].num_threads == 2
    assert [w.stages for w in dis.workers] == [["rollout"], ["reward", "advantage", "inference", "actor"]]
    assert [w.stages for w in hyb.workers] == [["rollout", "reward", "advantage"], ["inference", "actor"]]
    assert set(dis.micro_batch_size.values()) == {32}  # four micro-batches of whole groups
    with pytest.raises(ValueError, match="trainer.devices >= 2"):
        STRATEGIES.resolve("disaggregated").plan(wf, Resources(devices=1), batch)


class _Named(Stage):
    def __init__(self, name: str) -> None:
        self.name = name

    def process(self, batch):
        return batch


def test_trace_shows_overlap_only_when_disaggregated(assets, tmp_path):
    def spans(strategy):
        path = tmp_path / f"{strategy}.json"
        _fit(assets, tmp_path / strategy, strategy=strategy, launcher="processes", trace=str(path),
             max_iterations=2, micro_batch_size=4)  # fmt: skip
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        get = lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name]  # noqa: E731
        return get("rollout"), get("actor")

    def overlap(a, b):
        return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)

    rollout, actor = spans("disaggregated")
    assert len(rollout) == 2 * 4 and len(actor) == 2 * 4  # one span per micro-batch
    assert overlap(rollout, actor) > 0
    rollout, actor = spans("collocated")
    assert overlap(rollout, actor) == 0


# -- failures end the run with the worker's own error, never a hang ------------------------------


class Source(Stage):
    name = "source"

    def process(self, batch):
        return batch


class Boom(Stage):
    name = "boom"

    def process(self, batch):
        raise ValueError("bad batch in boom")


class Slow(Stage):
    name = "slow"

    def process(self, batch):
        time.sleep(60)


def _toy_runtime(launcher: str, *stages: Stage, timeout_s: float = 60.0):
    wf = Workflow("toy").chain(*stages)
    plan = STRATEGIES.resolve("disaggregated").plan(
        wf, Resources(devices=2, threads_per_slot=1), BatchShape(8, 4)
    )
    return LAUNCHERS.resolve(launcher).launch(wf, plan, timeout_s=timeout_s)


def _batches():
    return [TensorDict({"x": torch.zeros(4)}, batch_size=[4]) for _ in range(2)]


@pytest.mark.parametrize("launcher", LAUNCHER_NAMES)
def test_a_raising_worker_ends_the_run_with_its_traceback(launcher):
    rt = _toy_runtime(launcher, Source(), Boom())
    t0 = time.monotonic()
    try:
        with pytest.raises(StageError) as info:
            rt.run_iteration(1, _batches())
    finally:
        rt.shutdown()
    assert time.monotonic() - t0 < 30
    assert info.value.stage == "boom" and info.value.worker == "train"
    assert "ValueError: bad batch in boom" in info.value.tb and "test_plans.py" in info.value.tb


@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_a_killed_worker_process_ends_the_run_naming_it(launcher):
    rt = _toy_runtime(launcher, Source(), Slow())
    if launcher == "ray":
        import ray

        pid = ray.get(rt.actors["train"].pid.remote())
        how = "Ray actor died"
    else:
        pid = rt.procs["train"].pid
        how = "killed by SIGKILL"
    threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerDied, match=rf"worker 'train' hosting stage\(s\) slow died: {how}"):
            rt.run_iteration(1, _batches())
    finally:
        rt.shutdown()
    assert time.monotonic() - t0 < 30


def test_offload_context_switching_changes_nothing_but_memory(assets, tmp_path):
    _, _, plain = _fit(assets, tmp_path / "plain", strategy="collocated", devices=1, max_iterations=2)
    trainer, _, offl = _fit(
        assets, tmp_path / "offload", strategy="collocated_offload", devices=1, max_iterations=2
    )
    assert trainer.plan.workers[0].context_switch
    assert all(torch.equal(plain[k], offl[k]) for k in plain)


def test_offloader_spill_file_holds_state_and_leaves_nothing_on_disk(tmp_path):
    from rlinf_lightning.engines.offload import Offloader

    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def moments() -> list[torch.Tensor]:
        return [v for st in opt.state.values() for v in st.values() if v.dim()]

    saved = [v.clone() for v in moments()]
    off = Offloader("cpu", spill_dir=str(tmp_path))
    off.offload(model, opt)
    assert model.weight.numel() == 0 and not list(tmp_path.iterdir())  # unlinked while open
    off.onload(model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(saved, moments(), strict=True))


def _training_fit(assets, tmp_path, *overrides: str):
    """A long disaggregated `rlinf fit` on the processes launcher, returned once it trains.

    Returns the CLI process and the processes it spawned (workers, and ranks of their engines).
    """
    import subprocess

    import psutil

    fit = subprocess.Popen(
        cli_fit_args(
            assets,
            tmp_path,
            "--trainer.max_iterations=100000",
            "--trainer.rollout_batch_size=16",
            "--trainer.group_size=4",
            "--trainer.devices=2",
            "--trainer.strategy=disaggregated",
            "--trainer.launcher=processes",
            "--task.eval_size=8",
            "--trainer.enable_progress_bar=true",
            *overrides,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while "it " not in (line := fit.stdout.readline()):  # iterations print once workers are up
            assert line, fit.communicate(timeout=30)[1]  # the fit ended before training
        descendants = psutil.Process(fit.pid).children(recursive=True)
    except BaseException:
        fit.kill()
        raise
    return fit, [p for p in descendants if "spawn_main" in " ".join(p.cmdline())]


def test_killing_a_worker_ends_rlinf_fit_with_its_name(assets, tmp_path):
    """End to end: SIGKILL one worker process of a running `rlinf fit`; the CLI exits, naming it."""
    fit, workers = _training_fit(assets, tmp_path)
    try:
        assert len(workers) == 2
        workers[0].kill()
        t0 = time.monotonic()
        _, err = fit.communicate(timeout=30)
    finally:
        fit.kill()
    assert time.monotonic() - t0 < 30
    assert fit.returncode == 1
    assert "died: killed by SIGKILL" in err and "hosting stage(s)" in err


def test_killing_rlinf_fit_ends_its_workers_and_train_ranks(assets, tmp_path):
    """SIGKILL the driver of a fit whose actor trains on ddp ranks: no process is left behind."""
    import psutil

    fit, spawned = _training_fit(assets, tmp_path, "--trainer.train_strategy=ddp")
    fit.kill()
    fit.wait()
    assert len(spawned) == 4  # two workers, and the actor worker's two ddp ranks
    _, alive = psutil.wait_procs(spawned, timeout=20)
    assert not alive, [p.cmdline() for p in alive]
