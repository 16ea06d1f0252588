"""A tiny-VLA PPO iteration on ManiSkill3 PickCube-v1 from RGB images, through `rlinf fit`."""

from __future__ import annotations

from pathlib import Path

from rlinf_lightning.testing import check_one_embodied_iteration

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_vla_maniskill.yaml"


def test_a_tiny_vla_ppo_iteration_on_pickcube_rgb(tmp_path):
    check_one_embodied_iteration(CONFIG, tmp_path / "run")
