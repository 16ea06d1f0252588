"""A tiny-π0 PPO iteration (Flow-Noise log-probs) on LIBERO-Spatial from RGB images, through `rlinf
fit`: two envs, two chunks of 2 steps each (LIBERO steps slowly on a CPU)."""

from __future__ import annotations

from pathlib import Path

from rlinf_lightning.assets import build_tiny_pi0
from rlinf_lightning.testing import check_one_embodied_iteration

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_pi0_libero.yaml"


def test_a_tiny_pi0_ppo_iteration_on_libero_spatial(tmp_path):
    pi0 = build_tiny_pi0(tmp_path / "tiny-pi0")
    check_one_embodied_iteration(
        CONFIG,
        tmp_path / "run",
        f"--policy.init_args.model_path={pi0}",
        '--task.init_args.env_kwargs={"task_id": 0, "image_size": 64, "max_episode_steps": 6}',
        chunk=2,
    )
