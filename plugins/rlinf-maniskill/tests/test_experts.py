"""PickCube-v1's scripted expert (privileged state) through ``rlinf demos``: it succeeds, and the
file it writes replays as transitions that end where the episodes do."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.sft import record_expert_demos
from rlinf_lightning.workflows.offpolicy.demos import load_demo_transitions

KWARGS = {"obs_mode": "state", "control_mode": "pd_ee_delta_pos"}


def test_the_pickcube_expert_succeeds_and_its_demos_replay(tmp_path):
    path = tmp_path / "pickcube.safetensors"
    result = record_expert_demos("PickCube-v1", episodes=3, chunk=1, out=str(path), env_kwargs=KWARGS)
    assert result["expert_success"] == 1.0
    demos = load_demo_transitions(path, TensorDict({"state": torch.zeros(1, 42)}, batch_size=[1]))
    # ManiSkill ends an episode at success: three terminations, nothing kept after them
    assert int(demos["terminated"].sum()) == 3 and len(demos) < 3 * 50
