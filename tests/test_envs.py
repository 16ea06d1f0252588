"""The env contract on a real gymnasium-robotics task: tensors out, same-step auto-reset, final
observations for bootstrapping, success from the env's info."""

from __future__ import annotations

import pytest
import torch

from rlinf_lightning.envs import make_env
from rlinf_lightning.envs.time_aware import TimeAware
from rlinf_lightning.errors import ConfigError


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


class _ActionsEnv:
    """A gymnasium env with the action space it is given; its reward is the sum of the action it
    received (so a test sees what reached the simulator)."""

    def __new__(cls, action_space):
        import gymnasium as gym
        import numpy as np

        class Env(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (3,))

            def __init__(self):
                self.action_space = action_space

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return np.zeros(3, dtype=np.float32), {}

            def step(self, action):
                return np.zeros(3, dtype=np.float32), float(np.sum(action)), False, False, {}

        return Env()


def _actions_env(space, n=2):
    import gymnasium as gym

    if "rlinf-test/Actions-v0" not in gym.registry:
        gym.register("rlinf-test/Actions-v0", entry_point=_ActionsEnv)
    return make_env("rlinf-test/Actions-v0", n, action_space=space)


def test_discrete_action_spaces_are_indexes_from_zero_and_reach_the_env_offset_by_start():
    import gymnasium as gym

    cartpole = make_env("CartPole-v1", 2)
    assert (cartpole.action_shape, cartpole.action_choices) == ((), (2,))
    assert cartpole.action_low.dtype == torch.long and int(cartpole.action_high) == 1
    cartpole.close()
    env = _actions_env(gym.spaces.MultiDiscrete([3, 5], start=[1, -2]))
    assert (env.action_shape, env.action_choices) == ((2,), (3, 5))
    assert env.action_high.tolist() == [2, 4] and env.action_low.tolist() == [0, 0]
    env.reset(seed=0)
    step = env.step(torch.tensor([[2, 4], [0, 0]]))
    assert step.reward.tolist() == [(2 + 1) + (4 - 2), 1 - 2]  # index + start reached the env
    env.close()
    binary = _actions_env(gym.spaces.MultiBinary(3))
    assert (binary.action_shape, binary.action_choices) == ((3,), (2, 2, 2))
    binary.close()


def test_an_action_space_no_policy_serves_is_refused_naming_the_env_and_the_space():
    import gymnasium as gym

    from rlinf_lightning import RLTrainer
    from rlinf_lightning.errors import ConfigError
    from rlinf_lightning.policies import MLPActorCritic
    from rlinf_lightning.tasks import EmbodiedTask

    space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))
    with pytest.raises(ValueError, match=r"env 'rlinf-test/Actions-v0': action space Tuple\(Discrete\(2\)"):
        _actions_env(space)
    task = EmbodiedTask("rlinf-test/Actions-v0", env_kwargs={"action_space": space})
    with pytest.raises(ConfigError) as info:  # as a fit sees it: one line, before any worker
        RLTrainer(algorithm="ppo", devices=1, logger=False).validate(MLPActorCritic(), task)
    assert info.value.keys == ["task.env"] and "action space Tuple(" in str(info.value)


def test_time_aware_shows_the_elapsed_time_and_ends_the_episode_at_the_limit():
    """``time_aware``: ``obs["time"]`` counts the episode's steps over its limit, and the limit is
    a termination (no bootstrap) whose final observation reads 1.0; a reset starts at 0 again."""
    env = make_env("FetchReachDense-v4", 2, time_aware=True)
    try:
        obs = env.reset(seed=0)
        assert obs["time"].shape == (2, 1) and bool((obs["time"] == 0).all())
        for t in range(1, 51):
            step = env.step(torch.zeros(2, 4))
            if t < 50:
                assert torch.allclose(step.obs["time"], torch.full((2, 1), t / 50))
                assert not (step.terminated | step.truncated).any()
        assert step.terminated.all() and not step.truncated.any()
        assert bool((step.final_obs["time"] == 1.0).all()) and bool((step.obs["time"] == 0).all())
    finally:
        env.close()
    endless = make_env("FetchReachDense-v4", 1)
    endless.max_episode_steps = None  # as an env without a time limit declares
    with pytest.raises(ConfigError, match="task.time_aware: needs an env with a time limit"):
        TimeAware(endless)
