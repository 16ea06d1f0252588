"""TimeAware: the episode's elapsed time as an observation entry, and its time limit a terminal.

An env cut by a time limit whose observation does not show the time leaves the value function two
bad choices (Pardo et al., 2018, "Time Limits in Reinforcement Learning"): bootstrap at the cut
(partial-episode bootstrapping: the critic must learn the infinite-horizon value, which takes many
iterations where the policy rarely finishes the task inside the limit) or treat it as terminal (the
returns then depend on the time left, which the critic cannot see). With the elapsed fraction in the
observation the cut is a true terminal state of the augmented env, and the critic predicts the
return the episode will actually collect. Measured on FetchReachDense with a partly fitted π0: a
value function explained 12-37% of held-out chunk returns from the state alone, 79-90% with the time.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.envs.base import EnvBatch, Step
from rlinf_lightning.errors import ConfigError

#: the observation entry: ``[num_envs, 1]`` float32, steps taken in the episode / its time limit
TIME_KEY = "time"


class TimeAware(EnvBatch):
    """``env`` with ``obs["time"]`` (0 at a reset, 1 at the time limit) and its time-limit
    truncations reported as terminations (no bootstrap: the time is part of the state)."""

    def __init__(self, env: EnvBatch) -> None:
        if env.max_episode_steps is None:
            env.close()
            why = "needs an env with a time limit (max_episode_steps); set it in task.env_kwargs"
            raise ConfigError([("task.time_aware", why)])
        self.env = env
        self.num_envs, self.action_shape = env.num_envs, env.action_shape
        self.action_low, self.action_high = env.action_low, env.action_high
        self.action_choices, self.max_episode_steps = env.action_choices, env.max_episode_steps
        self.elapsed = torch.zeros(env.num_envs, dtype=torch.long)

    def _with_time(self, obs: TensorDict, elapsed: torch.Tensor) -> TensorDict:
        obs = obs.clone(recurse=False)
        obs[TIME_KEY] = (elapsed.float() / self.max_episode_steps)[:, None]
        return obs

    def reset(self, seed: int | list[int]) -> TensorDict:
        self.elapsed.zero_()
        return self._with_time(self.env.reset(seed), self.elapsed)

    def step(self, actions: torch.Tensor) -> Step:
        step = self.env.step(actions)
        self.elapsed += 1
        limit = step.truncated & (self.elapsed >= self.max_episode_steps)
        final_obs = None if step.final_obs is None else self._with_time(step.final_obs, self.elapsed)
        self.elapsed[step.terminated | step.truncated] = 0
        return Step(
            obs=self._with_time(step.obs, self.elapsed),
            reward=step.reward,
            terminated=step.terminated | limit,
            truncated=step.truncated & ~limit,
            success=step.success,
            final_obs=final_obs,
        )

    def close(self) -> None:
        self.env.close()
