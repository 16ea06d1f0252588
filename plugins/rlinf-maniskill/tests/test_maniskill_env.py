"""ManiSkill3 tasks through ``make_env``: the EnvBatch contract (tensors, same-step auto-reset with
final observations, time limit vs termination, success), reset by seed, state and RGB observations."""

from __future__ import annotations

import pytest
import torch
from rlinf_maniskill.env import ManiSkillEnvBatch, copy_states

from rlinf_lightning.envs import ENVS, make_env


@pytest.fixture
def closing():
    envs = []
    yield lambda env: envs.append(env) or env
    for env in envs:
        env.close()


def test_registered_through_the_entry_point(closing):
    rows = {name: origin for name, origin, _ in ENVS.describe()}
    assert rows["PickCube-v1"] == rows["PushCube-v1"] == "rlinf-maniskill"
    assert isinstance(closing(make_env("PickCube-v1", 1)), ManiSkillEnvBatch)


def test_pickcube_state_steps_to_the_time_limit_with_final_obs(closing):
    env = closing(make_env("PickCube-v1", 2))
    assert env.action_shape == (8,) and env.control_mode == "pd_joint_delta_pos"
    assert env.action_low.tolist() == [-1.0] * 8 and env.action_high.tolist() == [1.0] * 8
    assert env.max_episode_steps == 50
    obs = env.reset(seed=0)
    assert obs.batch_size == torch.Size([2]) and set(obs.keys()) == {"state"}
    assert obs["state"].dtype == torch.float32 and obs["state"].shape == (2, 42)
    for t in range(50):
        step = env.step(torch.zeros(2, 8))
        assert step.reward.shape == (2,) and step.reward.dtype == torch.float32
        assert set(step.success.tolist()) <= {0.0, 1.0}
        if t < 49:
            assert step.final_obs is None and not (step.truncated | step.terminated).any()
    assert step.truncated.all() and not step.terminated.any()  # ManiSkill's 50-step time limit
    assert step.final_obs is not None and step.final_obs.batch_size == torch.Size([2])
    # the reset observation is a new episode (a new cube and goal), final_obs the ended one's last
    assert not torch.equal(step.final_obs["state"], step.obs["state"])
    after = env.step(torch.zeros(2, 8))
    assert after.final_obs is None and not after.truncated.any()


def test_success_terminates_and_is_reported(closing):
    env = closing(make_env("PickCube-v1", 2))
    env.reset(seed=3)
    base = env.shards[0].base_env  # env 0's simulator: put the goal where the cube is
    from mani_skill.utils.structs.pose import Pose

    base.goal_site.set_pose(Pose.create_from_pq(p=base.cube.pose.p))
    step = env.step(torch.zeros(2, 8))
    assert step.terminated.tolist() == [True, False] and not step.truncated.any()
    assert step.success.tolist() == [1.0, 0.0]
    assert not torch.equal(step.final_obs["state"][0], step.obs["state"][0])  # env 0 was reset
    assert torch.equal(step.final_obs["state"][1], step.obs["state"][1])  # env 1 runs on


def test_reset_by_seed_is_deterministic_across_auto_resets(closing):
    a = closing(make_env("PickCube-v1", 2, max_episode_steps=3))
    b = closing(make_env("PickCube-v1", 2, max_episode_steps=3))
    obs_a, obs_b = a.reset(seed=7), b.reset(seed=7)
    assert a.max_episode_steps == 3 and torch.equal(obs_a["state"], obs_b["state"])
    assert not torch.equal(obs_a["state"][0], obs_a["state"][1])  # env i is seeded with seed + i
    assert not torch.equal(a.reset(seed=8)["state"], obs_b["state"])
    a.reset(seed=7)
    gen = torch.Generator().manual_seed(0)
    for t in range(1, 8):  # two auto-resets: the later episodes follow from the seed too
        action = torch.rand(2, 8, generator=gen) * 2 - 1
        torch.rand(5)  # the process's global RNG does not drive the episodes
        sa, sb = a.step(action), b.step(action)
        assert torch.equal(sa.obs["state"], sb.obs["state"])
        assert sa.truncated.tolist() == [t % 3 == 0] * 2
    # one seed per env: equal seeds start equal episodes (a GRPO group)
    grouped = a.reset([11, 11])["state"]
    assert torch.equal(grouped[0], grouped[1])


def test_copy_states_sets_an_env_to_another_ones_state(closing):
    env = closing(make_env("PickCube-v1", 1))
    obs = env.reset(seed=5)
    again = copy_states(env.shards[0], [0])  # the GPU path of grouped seeds, on one CPU env
    assert torch.allclose(env._entries(again, 1)["state"], obs["state"], atol=1e-5)


def test_pickcube_rgb_observations(closing):
    from rlinf_lightning.flow.channel import decode, encode

    env = closing(make_env("PickCube-v1", 2, obs_mode="rgb", image_size=64))
    obs = env.reset(seed=0)
    assert set(obs.keys()) == {"rgb", "state", "instruction"}
    assert obs["rgb"].dtype == torch.uint8 and obs["rgb"].shape == (2, 64, 64, 3)
    assert obs["rgb"].float().std() > 10  # a rendered scene, not a blank image
    assert obs["state"].dtype == torch.float32 and obs["state"].shape == (2, 29)
    assert list(obs["instruction"]) == ["pick up the red cube and move it to the goal position"] * 2
    again = env.reset(seed=0)
    assert torch.equal(again["rgb"], obs["rgb"]) and torch.equal(again["state"], obs["state"])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        step = env.step(torch.rand(2, 8, generator=gen) * 2 - 1)
        assert step.obs["rgb"].shape == (2, 64, 64, 3) and step.obs["rgb"].dtype == torch.uint8
    assert not torch.equal(step.obs["rgb"], obs["rgb"])
    # observations cross process boundaries (the processes launcher's channels) intact
    back = decode(encode(step.obs))
    assert torch.equal(back["rgb"], step.obs["rgb"]) and list(back["instruction"]) == list(
        step.obs["instruction"]
    )


def test_pushcube_constructs_with_an_end_effector_controller(closing):
    env = closing(make_env("PushCube-v1", 2, control_mode="pd_ee_delta_pose", instruction=True))
    assert env.action_shape == (7,) and env.max_episode_steps == 50
    obs = env.reset(seed=0)
    assert obs["state"].dtype == torch.float32 and obs["state"].shape[0] == 2
    assert list(obs["instruction"]) == ["push the blue cube to the red and white target"] * 2
    step = env.step(torch.zeros(2, 7))
    assert set(step.success.tolist()) <= {0.0, 1.0}


def test_a_bad_obs_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="obs_mode must be one of"):
        make_env("PickCube-v1", 1, obs_mode="pointcloud")
