"""An environment is an ``EnvBatch``: ``num_envs`` copies stepped together, tensors in and out."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from rlinf_lightning.envs.base import EnvBatch, Step


class PointReach(EnvBatch):
    """A point in the unit square moves by ``0.1 x action`` per step toward a random target.

    Observation ``state``: position and target (4 floats). Reward: minus the distance. An episode
    succeeds and terminates within 0.05 of the target, and is truncated after
    ``max_episode_steps``; it then resets in the same step (``final_obs`` keeps its last state).
    """

    action_shape = (2,)

    def __init__(self, num_envs: int, max_episode_steps: int = 20) -> None:
        self.num_envs, self.max_episode_steps = num_envs, max_episode_steps
        self.action_low, self.action_high = -torch.ones(2), torch.ones(2)
        self.rngs = [np.random.default_rng(i) for i in range(num_envs)]
        self.pos = np.zeros((num_envs, 2), np.float32)
        self.target = np.zeros((num_envs, 2), np.float32)
        self.t = np.zeros(num_envs, np.int64)

    def _start(self, i: int) -> None:
        self.pos[i], self.target[i] = self.rngs[i].random(2), self.rngs[i].random(2)
        self.t[i] = 0

    def _obs(self) -> TensorDict:
        state = torch.from_numpy(np.concatenate([self.pos, self.target], 1).copy())
        return TensorDict({"state": state}, batch_size=[self.num_envs])

    def reset(self, seed: int | list[int]) -> TensorDict:
        seeds = seed if isinstance(seed, list) else [seed + i for i in range(self.num_envs)]
        self.rngs = [np.random.default_rng(s) for s in seeds]
        for i in range(self.num_envs):
            self._start(i)
        return self._obs()

    def step(self, actions: torch.Tensor) -> Step:
        self.pos = np.clip(self.pos + 0.1 * actions.numpy().astype(np.float32), 0.0, 1.0)
        self.t += 1
        dist = np.linalg.norm(self.pos - self.target, axis=1)
        terminated, truncated = dist < 0.05, (self.t >= self.max_episode_steps) & (dist >= 0.05)
        ended = terminated | truncated
        final_obs = self._obs() if ended.any() else None
        for i in np.flatnonzero(ended):
            self._start(i)
        return Step(
            obs=self._obs(),
            reward=torch.from_numpy(-dist.astype(np.float32)),
            terminated=torch.from_numpy(terminated),
            truncated=torch.from_numpy(truncated),
            success=torch.from_numpy(terminated.astype(np.float32)),
            final_obs=final_obs,
        )
