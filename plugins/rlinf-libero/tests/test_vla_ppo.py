"""A tiny-VLA PPO iteration on LIBERO-Spatial from RGB images, through `rlinf fit`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_vla_libero.yaml"


def test_a_tiny_vla_ppo_iteration_on_libero_spatial(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={CONFIG}",
            "--trainer.max_iterations=1", "--trainer.logger=false", f"--trainer.default_root_dir={run}",
            "--task.init_args.num_envs=2", "--task.init_args.steps=4", "--task.init_args.eval_episodes=2",
            '--task.init_args.env_kwargs={"task_id": 0, "image_size": 64, "max_episode_steps": 6}',
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 1 and "success_before" in summary and "success_after" in summary
    assert "env -> rollout -> advantage -> actor" in res.stdout  # the plan table
    assert (run / "checkpoints" / "iter-000001" / "model.safetensors").is_file()
