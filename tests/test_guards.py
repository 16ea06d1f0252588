"""Runs that must not go on: a learner's non-finite step is skipped and counted, several in a row
(or advantages and rewards that are not finite) stop the run with one line and leave the last
checkpoint intact; running out of memory in a stage ends the run with one line naming the stage,
the device, the budget in force, the keys that lower it and the plan's estimate, its traceback
in the run's log file. Real components: the MLP actor-critic on CartPole, in process."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import PPO
from rlinf_lightning.checkpoint import load_checkpoint, resolve_checkpoint
from rlinf_lightning.errors import RunError
from rlinf_lightning.policies import MLPActorCritic
from rlinf_lightning.tasks import EmbodiedTask
from trainer_defaults import MetricsRecorder, scaled


class PoisonedPolicy(MLPActorCritic):
    """Its actor's log-probs are NaN on the samples of ``poison`` iterations (those produced by
    weights version ``iteration - 1``): each such iteration's one optimizer step has a NaN loss.
    A class attribute, set by each test: not part of the run's configuration."""

    poison: tuple[int, ...] = ()

    def evaluate(self, batch):
        logprob, entropy, value = super().evaluate(batch)
        if int(batch["policy_version"][0]) + 1 in self.poison:
            logprob = logprob * float("nan")
        return logprob, entropy, value


class OutOfMemoryPolicy(MLPActorCritic):
    """The allocation of the actor's forward fails as a GPU's does (``torch.OutOfMemoryError``)."""

    def evaluate(self, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test double)")


def _fit(tmp_path: Path, policy, iterations: int = 5, ckpt_path: str | None = None, **trainer):
    task = EmbodiedTask(
        "CartPole-v1", env_kwargs={"max_episode_steps": 16}, num_envs=4, steps=8,
        eval_episodes=2, eval_metric="return",
    )  # fmt: skip
    recorder = MetricsRecorder()
    t = RLTrainer(
        algorithm=PPO(update_epochs=1, num_minibatches=1), max_iterations=iterations, ckpt_every=1,
        default_root_dir=str(tmp_path / "run"), logger=False, enable_progress_bar=False,
        callbacks=[recorder], timeout_s=scaled(60), **trainer,
    )  # fmt: skip
    return t, t.fit(policy, task, ckpt_path=ckpt_path), recorder


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_a_non_finite_step_is_skipped_counted_and_training_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(PoisonedPolicy, "poison", (2,))
    t, summary, rec = _fit(tmp_path, PoisonedPolicy(hidden_sizes=(16,), lr=1e-2))
    assert [m["actor/nonfinite_steps"] for m in rec.metrics] == [0, 1, 1, 1, 1]
    assert "actor/loss" not in rec.metrics[1] and all(math.isfinite(m["actor/loss"]) for m in rec.metrics[2:])
    ckpts = t.ckpt_dir
    skipped, before, last = (_weights(ckpts / f"iter-00000{i}") for i in (2, 1, 5))
    assert all(torch.equal(skipped[k], before[k]) for k in before)  # iteration 2 took no step
    assert all(torch.isfinite(v).all() for v in last.values())
    assert any(not torch.equal(last[k], before[k]) for k in before)  # and the others trained
    assert summary["nonfinite_steps"] == {"actor": 1}
    warnings = [r.message for r in caplog.records if "non-finite loss at iteration 2" in r.message]
    assert len(warnings) == 1, caplog.text


def test_non_finite_steps_in_a_row_stop_the_run_and_the_last_checkpoint_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(PoisonedPolicy, "poison", (3, 4, 5))
    with pytest.raises(RunError) as info:
        _fit(tmp_path, PoisonedPolicy(hidden_sizes=(16,)), iterations=6)
    line = str(info.value)
    assert "\n" not in line
    assert "stage 'actor' stopped the run: non-finite loss at iteration 5, 3 optimizer steps in a row" in line
    assert "trainer.max_consecutive_nonfinite=3" in line and "iter-000004, is intact" in line
    path = resolve_checkpoint("last", tmp_path / "run" / "checkpoints")
    assert path.name == "iter-000004"
    model, state, _ = load_checkpoint(path)
    assert state["iteration"] == 4 and all(torch.isfinite(v).all() for v in model["model"].values())
    log = (tmp_path / "run" / "run.log").read_text()
    assert line in log and "NonFiniteError" in log  # the traceback went to the file
    monkeypatch.setattr(PoisonedPolicy, "poison", ())  # the cause fixed: the run resumes from it
    _, summary, _ = _fit(tmp_path, PoisonedPolicy(hidden_sizes=(16,)), iterations=6, ckpt_path="last")
    assert summary["resumed_from_iteration"] == 4 and summary["nonfinite_steps"] == {"actor": 0}


def test_on_nonfinite_stop_ends_the_run_at_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(PoisonedPolicy, "poison", (2,))
    with pytest.raises(RunError, match="non-finite loss at iteration 2, \\(trainer.on_nonfinite=stop\\)"):
        _fit(tmp_path, PoisonedPolicy(hidden_sizes=(16,)), on_nonfinite="stop")


def test_non_finite_rewards_stop_the_run_naming_the_stage(tmp_path, monkeypatch):
    from rlinf_lightning.workflows.embodied.advantage import GAEStage

    process = GAEStage.process

    def poisoned(self, traj):
        if self.iteration == 2:
            traj["reward"][0, 0] = float("inf")
        return process(self, traj)

    monkeypatch.setattr(GAEStage, "process", poisoned)
    with pytest.raises(RunError) as info:
        _fit(tmp_path, MLPActorCritic(hidden_sizes=(16,)), iterations=3)
    assert str(info.value).startswith(
        "stage 'advantage' stopped the run: non-finite rewards at iteration 2 (1 of 32 values inf)"
    )
    assert "iter-000001, is intact" in str(info.value)


def test_out_of_memory_in_the_actor_is_one_line_with_its_budget_and_the_plans_estimate(tmp_path):
    with pytest.raises(RunError) as info:
        _fit(tmp_path, OutOfMemoryPolicy(hidden_sizes=(16,)), iterations=2)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("stage 'actor' ran out of memory on cpu (worker ")
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in line
    assert "minibatches of 32 samples in one forward/backward in force" in line
    assert "(lower task.train_micro_batch_size, trainer.algorithm.num_minibatches)" in line
    assert re.search(r"memory check predicted \d+ KiB for it on cpu \(\d+ KiB for the worker", line)
    assert "no checkpoint was written yet" in line
    log = (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in log and "test double" in log


def test_the_cli_prints_an_out_of_memory_as_one_line_and_exits_1(tmp_path, capsys):
    from rlinf_lightning.cli import main

    config = Path(__file__).parents[1] / "configs" / "embodied_ppo_cartpole.yaml"
    status = main([
        "fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.max_iterations=1", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        "--policy.class_path=test_guards.OutOfMemoryPolicy", "--task.init_args.eval_episodes=1",
        "--task.init_args.env_kwargs={max_episode_steps: 8}",
    ])  # fmt: skip
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("rlinf")]
    assert status == 1 and len(lines) == 1, err
    assert lines[0].startswith("rlinf fit: stage 'actor' ran out of memory on cpu"), err
    assert "Traceback" not in err and "task.train_micro_batch_size" in lines[0]


def test_the_out_of_memory_line_of_each_reasoning_stage_names_its_own_budget(assets, tmp_path):
    """The line is completed on the driver from the plan: the actor's micro-batches, the rollout's
    messages and new tokens, each with the keys that lower them and the plan's estimate."""
    from rlinf_lightning.flow.worker import StageError
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.trainer.failures import failure_line
    from trainer_defaults import tiny_task, tiny_trainer_kwargs

    trainer = RLTrainer(**tiny_trainer_kwargs(tmp_path))
    task = tiny_task(assets, train_micro_batch_size=8)
    workflow, plan = trainer.validate(LMPolicy(str(assets["sft"])), task)

    def line(stage: str) -> str:
        why = f"stage {stage!r} ran out of memory"
        exc = StageError(stage, "all/0", "Traceback ...", "out_of_memory", why)
        return failure_line(exc, workflow, plan, trainer.ckpt_dir, tmp_path / "run.log")

    actor, rollout = line("actor"), line("rollout")
    assert "micro-batches of 8 samples in force (lower task.train_micro_batch_size)" in actor
    assert re.search(r"memory check predicted [\d.]+ MiB for it on cpu", actor), actor
    assert "messages of 16 samples of up to " in rollout and "task.sampling.max_new_tokens" in rollout
    other = StageError("actor", "all/0", "tb")  # any other error: its traceback is the report
    assert failure_line(other, workflow, plan, trainer.ckpt_dir, tmp_path) is None
