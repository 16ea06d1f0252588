"""Bad configs fail fast (before any model loads) with one error naming the key and the fix."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.tasks.math import MathTask
from rlinf_lightning.trainer import RLTrainer
from trainer_defaults import cli_fit_args


def _fit(tmp_path: Path, assets: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_fit_args(assets, tmp_path, *overrides), capture_output=True, text=True, timeout=60
    )


HYBRID = "rlinf_lightning.strategies.HybridStrategy"
BAD = [
    ("--trainer.max_iteration=3", "trainer.max_iteration"),  # unknown key (typo)
    ("--trainer.group_size=four", "trainer.group_size"),  # wrong type
    ("--policy.model_path=/nonexistent/model", "policy.model_path"),  # missing model path
    ("--trainer.group_size=1", "trainer.group_size"),  # group size < 2
    ("--trainer.rollout_batch_size=100", "trainer.rollout_batch_size"),  # not divisible by 8
    ("--trainer.strategy=colocated", "trainer.strategy"),  # unknown strategy
    ("--trainer.sampling.temperature=0", "trainer.sampling.temperature"),  # greedy RL sampling
    ("--task.reward=exact", "task.reward"),  # unknown reward
    ("--trainer.train_engine_options={timeout: 9}", "trainer.train_engine_options.timeout"),  # no such option
    (  # glibc caps the mmap threshold at 32 MiB
        ("--trainer.train_strategy=fsdp", "--trainer.train_engine_options={malloc_mmap_threshold_mb: 64}"),
        "malloc_mmap_threshold_mb must be in (0, 32]",
    ),
    (  # a placement naming a stage the workflow does not have
        f"--trainer.strategy={{class_path: {HYBRID}, init_args: {{placement: 'rolout: 0'}}}}",
        "unknown stage 'rolout'",
    ),
    (  # a placement on a slot that does not exist
        (
            "--trainer.devices=2",
            "--trainer.strategy={class_path: rlinf_lightning.strategies.HybridStrategy, "
            "init_args: {placement: 'rollout: 0, reward,advantage,inference,actor: 2'}}",
        ),
        "slot 2 does not exist",
    ),  # fmt: skip
    (  # one train replica for a plan that runs the actor on two
        ("--trainer.devices=2", "--trainer.train_strategy=single"),
        "trainer.train_strategy",
    ),
    (  # fsdp over replicas that are threads of one process
        ("--trainer.devices=2", "--trainer.train_strategy=fsdp", "--trainer.launcher=inprocess"),
        "trainer.launcher",
    ),
]


@pytest.mark.parametrize(("override", "key"), BAD, ids=[k for _, k in BAD])
def test_bad_config_fails_fast_naming_the_key(tmp_path, assets, override, key):
    t0 = time.perf_counter()
    res = _fit(tmp_path, assets, *([override] if isinstance(override, str) else override))
    elapsed = time.perf_counter() - t0
    assert res.returncode != 0
    assert key in res.stderr, res.stderr
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_suggests_the_nearest_name(tmp_path, assets):
    res = _fit(tmp_path, assets, "--trainer.strategy=colocated")
    assert "collocated" in res.stderr


def test_good_config_prints_itself(tmp_path, assets):
    res = _fit(tmp_path, assets, "--print_config")
    assert res.returncode == 0, res.stderr
    assert "max_iterations:" in res.stdout and "temperature:" in res.stdout


def test_validate_collects_every_problem(assets):
    trainer = RLTrainer(group_size=3, rollout_batch_size=16, devices=0)
    with pytest.raises(ConfigError) as info:
        trainer.validate(LMPolicy(str(assets["sft"])), MathTask(str(assets["train"]), "missing.jsonl"))
    assert set(info.value.keys) >= {"trainer.rollout_batch_size", "trainer.devices", "task.test_path"}
