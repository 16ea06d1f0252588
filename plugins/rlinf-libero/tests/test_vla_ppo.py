"""A tiny-VLA PPO iteration on LIBERO-Spatial from RGB images, through `rlinf fit`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_lightning.testing import check_one_embodied_iteration

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_vla_libero.yaml"


# 185 s in CI: the default run fits π0 on LIBERO and the tiny VLA on ManiSkill, one policy per
# simulator; the other two pairings run with `-m slow`
@pytest.mark.slow
def test_a_tiny_vla_ppo_iteration_on_libero_spatial(tmp_path):
    check_one_embodied_iteration(
        CONFIG,
        tmp_path / "run",
        '--task.init_args.env_kwargs={"task_id": 0, "image_size": 64, "max_episode_steps": 6}',
    )
