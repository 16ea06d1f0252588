"""A tiny-VLA PPO iteration on LIBERO-Spatial from RGB images, through `rlinf fit`."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_vla_libero.yaml"


def test_a_tiny_vla_ppo_iteration_on_libero_spatial(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={CONFIG}",
            "--trainer.max_iterations=1", f"--trainer.default_root_dir={run}",
            "--task.init_args.num_envs=2", "--task.init_args.steps=4", "--task.init_args.eval_episodes=2",
            '--task.init_args.env_kwargs={"task_id": 0, "image_size": 64, "max_episode_steps": 6}',
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 1 and summary["eval_episodes"] == 2
    for key in ("success_before", "success_after"):
        assert summary[key] in (0.0, 0.5, 1.0), key  # 2 episodes, each a success or not
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        (step,) = [row for row in csv.DictReader(f) if row.get("actor/loss")]
    assert float(step["env/env_steps_total"]) == 2 * 4  # num_envs x steps
    # PPO's update ran on real values: a finite loss and a non-zero gradient (the value loss alone
    # gives one)
    assert math.isfinite(float(step["actor/loss"])) and float(step["actor/grad_norm"]) > 0
    assert "env -> rollout -> advantage -> actor" in res.stdout  # the plan table
    assert (run / "checkpoints" / "iter-000001" / "model.safetensors").is_file()
