"""Runs do not collide: a run records its resolved configuration (the algorithm included) in its
directory, its checkpoints and its summary; a new run is refused where another configuration's
checkpoints lie, and a resume across a change of what makes the update is refused naming the keys,
unless ``trainer.allow_config_change``. Real components: the MLP actor-critic on CartPole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import GRPO, PPO
from rlinf_lightning.errors import CheckpointError, ConfigError
from rlinf_lightning.policies import MLPActorCritic
from rlinf_lightning.tasks import EmbodiedTask
from trainer_defaults import scaled


def _fit(root: Path, algorithm, iterations: int = 2, ckpt_path: str | None = None, **over):
    task = EmbodiedTask(
        "CartPole-v1", env_kwargs={"max_episode_steps": 16}, num_envs=4, steps=8, group_size=2,
        eval_episodes=2, eval_metric="return", **over.pop("task", {}),
    )  # fmt: skip
    trainer = RLTrainer(
        algorithm=algorithm, max_iterations=iterations, default_root_dir=str(root), logger=False,
        enable_progress_bar=False, timeout_s=scaled(60), **over,
    )  # fmt: skip
    return trainer.fit(MLPActorCritic(hidden_sizes=(16,)), task, ckpt_path=ckpt_path)


def test_the_summary_and_the_run_directory_hold_the_resolved_configuration(tmp_path, caplog):
    caplog.set_level("INFO", logger="rlinf_lightning")
    summary = _fit(tmp_path / "run", PPO(update_epochs=1, num_minibatches=2))
    algorithm = summary["config"]["trainer"]["algorithm"]
    assert summary["algorithm"] == "PPO" and algorithm["class_path"] == "rlinf_lightning.algorithms.ppo.PPO"
    assert algorithm["init_args"]["update_epochs"] == 1 and algorithm["init_args"]["num_minibatches"] == 2
    assert summary["config"]["task"]["init_args"]["env"] == "CartPole-v1"
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == summary["config"]
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter-000002" / "state.json").read_text())
    assert state["config"] == summary["config"]
    assert "algorithm: PPO (update_epochs=1, num_minibatches=2)" in caplog.text  # with the plan


def test_a_run_with_another_algorithm_does_not_take_over_the_first_ones_directory(tmp_path):
    root = tmp_path / "run"
    _fit(root, PPO(update_epochs=1))
    summary, last = (root / "summary.json").read_text(), (root / "checkpoints" / "last").read_text()
    with pytest.raises(ConfigError) as info:
        _fit(root, GRPO(), iterations=1)
    assert info.value.keys == ["trainer.default_root_dir"]
    assert "differs on trainer.algorithm (PPO there, GRPO here)" in str(info.value)
    assert (root / "summary.json").read_text() == summary  # neither overwritten
    assert (root / "checkpoints" / "last").read_text() == last == "iter-000002"
    _fit(root, PPO(update_epochs=1), iterations=1)  # the same configuration again may (re)write it
    _fit(root, GRPO(), iterations=1, allow_config_change=True)  # and anything, when asked to
    assert json.loads((root / "summary.json").read_text())["algorithm"] == "GRPO"


def test_resuming_under_another_algorithm_is_refused_naming_it(tmp_path):
    root = tmp_path / "run"
    _fit(root, PPO(update_epochs=1))
    with pytest.raises(CheckpointError) as info:
        _fit(root, GRPO(), iterations=3, ckpt_path="last")
    message = str(info.value)
    assert "\n" not in message and "iter-000002: written by a run with another configuration" in message
    assert "trainer.algorithm (PPO there, GRPO here)" in message and "trainer.allow_config_change" in message
    with pytest.raises(CheckpointError, match=r"trainer.algorithm.update_epochs \(1 there, 2 here\)"):
        _fit(root, PPO(update_epochs=2), iterations=3, ckpt_path="last")
    # what changes only how the update runs may change: the micro-batches, the evaluation
    summary = _fit(
        root, PPO(update_epochs=1), iterations=3, ckpt_path="last",
        task={"train_micro_batch_size": 8}, eval_every=1,
    )  # fmt: skip
    assert summary["resumed_from_iteration"] == 2
    summary = _fit(root, GRPO(), iterations=4, ckpt_path="last", allow_config_change=True)
    assert summary["resumed_from_iteration"] == 3 and summary["algorithm"] == "GRPO"


def test_ckpt_keep_leaves_the_newest_checkpoints_and_a_run_resumes_from_them(tmp_path):
    root, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _fit(root, PPO(update_epochs=1), iterations=5, ckpt_every=1, ckpt_keep=3)
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter-000003", "iter-000004", "iter-000005", "last"]
    # resumed from an earlier one: what it passes is pruned, what lies beyond it (another history's)
    # and what is not a checkpoint's name stay
    (ckpts / "iter-notes").mkdir()
    _fit(
        root,
        PPO(update_epochs=1),
        iterations=4,
        ckpt_every=1,
        ckpt_keep=1,
        ckpt_path=str(ckpts / "iter-000003"),
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter-000004", "iter-000005", "iter-notes", "last"]
    assert (ckpts / "last").read_text() == "iter-000004"
    with pytest.raises(ConfigError, match=r"trainer.ckpt_keep: must be >= 0, got -1"):
        _fit(root, PPO(update_epochs=1), ckpt_keep=-1)
