"""Bad configs fail fast (before any model loads) with one error naming the key and the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.tasks.math import MathTask
from rlinf_lightning.trainer import RLTrainer
from trainer_defaults import cli_fit_args, scaled


def _fit(tmp_path: Path, assets: dict, *overrides: str) -> subprocess.CompletedProcess:
    """`rlinf fit` in a subprocess; its timeout catches a hang only: importing the CLI took over
    60 s on a 2-core machine at load 5-14."""
    return subprocess.run(
        cli_fit_args(assets, tmp_path, *overrides), capture_output=True, text=True, timeout=scaled(300)
    )


def test_a_bad_config_exits_2_with_one_message_from_the_console_script(tmp_path, assets):
    """Through a real subprocess (tests/test_bad_inputs.py covers the cases in-process). Refused
    before anything starts: nothing but the message is printed and no run directory is made (no
    wall-clock bound: on a loaded machine importing the CLI alone took 10 s)."""
    res = _fit(tmp_path, assets, "--task.rollout_batch_size=100")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "rlinf fit: invalid configuration:",
        "  task.rollout_batch_size: 100 is not divisible by task.group_size=8; use a multiple such as 96",
    ]
    assert not (tmp_path / "run").exists()


def test_good_config_prints_itself(tmp_path, assets):
    res = _fit(tmp_path, assets, "--print_config")
    assert res.returncode == 0, res.stderr
    assert "max_iterations:" in res.stdout and "temperature:" in res.stdout


def test_validate_collects_every_problem(assets):
    trainer = RLTrainer(devices=0)
    task = MathTask(str(assets["train"]), "missing.jsonl", group_size=3, rollout_batch_size=16)
    with pytest.raises(ConfigError) as info:
        trainer.validate(LMPolicy(str(assets["sft"])), task)
    assert set(info.value.keys) >= {"task.rollout_batch_size", "trainer.devices", "task.test_path"}
