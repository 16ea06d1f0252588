"""The env contract on a real gymnasium-robotics task: tensors out, same-step auto-reset, final
observations for bootstrapping, success from the env's info."""

from __future__ import annotations

import pytest
import torch

from rlinf_lightning.envs import make_env


def test_a_gymnasium_id_steps_as_an_env_batch():
    env = make_env("FetchReachDense-v4", 3)
    try:
        obs = env.reset(seed=0)
        assert obs.batch_size == torch.Size([3]) and obs["observation"].dtype == torch.float32
        assert env.action_shape == (4,) and env.max_episode_steps == 50
        again = make_env("FetchReachDense-v4", 3)
        assert torch.equal(again.reset(seed=0)["desired_goal"], obs["desired_goal"])  # seeded
        again.close()
        for t in range(50):
            step = env.step(torch.zeros(3, 4))
            if t < 49:
                assert step.final_obs is None and not step.truncated.any()
        assert step.truncated.all() and not step.terminated.any()  # the 50-step time limit
        assert step.final_obs is not None
        # the reset observation differs from the ended episode's last one (a new goal is drawn)
        assert not torch.equal(step.final_obs["desired_goal"], step.obs["desired_goal"])
        assert set(step.success.tolist()) <= {0.0, 1.0} and step.reward.shape == (3,)
    finally:
        env.close()


def test_an_unknown_env_name_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown env 'FetchReachDense-v9'.*did you mean 'FetchReachDense-v4'"):
        make_env("FetchReachDense-v9", 1)
