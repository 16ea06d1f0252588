"""A tiny-π0 PPO iteration (Flow-Noise log-probs) on ManiSkill3 PickCube-v1 from RGB images, through
`rlinf fit`; run with `python -m pytest -q plugins/rlinf-maniskill/tests -k pi0`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_lightning.assets import build_tiny_pi0
from rlinf_lightning.testing import check_one_embodied_iteration

CONFIG = Path(__file__).parents[3] / "configs" / "embodied_ppo_pi0_maniskill.yaml"


# 84 s in CI: the default run fits π0 on LIBERO and the tiny VLA on ManiSkill, one policy per
# simulator; the other two pairings run with `-m slow`
@pytest.mark.slow
def test_a_tiny_pi0_ppo_iteration_on_pickcube_rgb(tmp_path):
    pi0 = build_tiny_pi0(tmp_path / "tiny-pi0")
    check_one_embodied_iteration(CONFIG, tmp_path / "run", f"--policy.init_args.model_path={pi0}", chunk=5)
