"""A user's RLModule subclass by class_path from YAML: ``examples/warmup_policy.py`` runs through
`rlinf fit`, its LR schedule steps once per iteration and resumes exactly, and what it logs with
``self.log`` reaches the CSV logger."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer_defaults import cli_fit_args, logged_metrics

EXAMPLES = Path(__file__).parents[1] / "examples"


def _fit(assets, run: Path, *extra: str) -> subprocess.CompletedProcess:
    config = run.parent / f"{run.name}.yaml"
    config.write_text(
        "policy:\n"
        "  class_path: warmup_policy.WarmupLMPolicy\n"
        "  init_args:\n"
        f"    model_path: {assets['sft']}\n"
        "    lr: 0.0004\n"
        "    warmup_iterations: 4\n"
    )
    args = cli_fit_args(
        assets, run, f"--config={config}", "--task.rollout_batch_size=16", "--task.group_size=4",
        "--task.eval_size=8", "--trainer.ckpt_every=1", *extra,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def test_class_path_policy_with_scheduler_and_self_log(assets, tmp_path):
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run "b", beside "a" and its resume
        uninterrupted = pool.submit(_fit, assets, tmp_path / "b", "--trainer.max_iterations=3")
        res = _fit(assets, tmp_path / "a", "--trainer.max_iterations=2")
        assert res.returncode == 0, res.stderr
        rows = logged_metrics(tmp_path / "a" / "run")
        # LinearLR from 1/4 to 1 of 4e-4 over 4 steps: factors 0.25, 0.4375, 0.625, ...
        assert [float(rows[i]["actor/lr"]) for i in (1, 2)] == pytest.approx([1e-4, 1.75e-4])
        assert float(rows[2]["actor/policy/response_logprob"]) < 0
        assert (tmp_path / "a" / "run" / "checkpoints" / "iter-000002" / "lr_scheduler.pt").is_file()
        res = _fit(assets, tmp_path / "a", "--trainer.max_iterations=3", "--ckpt_path=last")
        assert res.returncode == 0, res.stderr
        resumed = logged_metrics(tmp_path / "a" / "run", 1)[3]
        assert float(resumed["actor/lr"]) == pytest.approx(2.5e-4)  # the schedule resumed
        # exactly: iteration 3 logs what it logs in an uninterrupted run, and ends on the same weights
        res = uninterrupted.result()
        assert res.returncode == 0, res.stderr
        straight = logged_metrics(tmp_path / "b" / "run")[3]
        for key in ("lr", "loss", "grad_norm", "policy/response_logprob"):
            assert resumed[f"actor/{key}"] == straight[f"actor/{key}"], key
        assert resumed["reward/reward"] == straight["reward/reward"]
    last = Path("run", "checkpoints", "iter-000003", "model.safetensors")
    a, b = load_file(str(tmp_path / "a" / last)), load_file(str(tmp_path / "b" / last))
    assert all(torch.equal(a[k], b[k]) for k in b)
