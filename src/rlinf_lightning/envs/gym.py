"""Any gymnasium environment id as an :class:`~rlinf_lightning.envs.base.EnvBatch`.

``gymnasium.make_vec`` in the same process (``sync``), auto-reset in the same step (gymnasium's
``SAME_STEP`` mode: the final observation comes in ``info["final_obs"]``). Ids of
gymnasium-robotics (``FetchReachDense-v4``, ...) are registered on first use when the package is
installed. Dict observations become one entry per key; images stay uint8. Actions are a ``Box``
(continuous) or discrete: ``Discrete``, ``MultiDiscrete``, ``MultiBinary`` (``EnvBatch.action_choices``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlinf_lightning.envs.base import EnvBatch, Step


def ensure_registered(env_id: str) -> None:
    """Register gymnasium-robotics' envs if ``env_id`` needs them; ``KeyError`` (with the nearest
    id) if gymnasium still does not know it."""
    import gymnasium as gym

    if env_id in gym.registry:
        return
    try:
        import gymnasium_robotics

        gym.register_envs(gymnasium_robotics)
    except ImportError:
        pass
    if env_id not in gym.registry:
        import difflib

        close = difflib.get_close_matches(env_id, list(gym.registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown env {env_id!r}: not registered with rlinf_lightning nor gymnasium{hint}")


def _tensor(x: np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x))
    return t if t.dtype == torch.uint8 else t.to(torch.float32)


def to_tensordict(obs: Any, n: int) -> TensorDict:
    """A gymnasium vector observation (array or dict of arrays) as a ``TensorDict`` of batch ``[n]``."""
    if isinstance(obs, dict):
        return TensorDict({k: _tensor(v) for k, v in obs.items()}, batch_size=[n])
    return TensorDict({"observation": _tensor(obs)}, batch_size=[n])


class GymEnvBatch(EnvBatch):
    """``num_envs`` copies of the gymnasium env ``env_id`` (keyword arguments go to ``gym.make``)."""

    def __init__(self, env_id: str, num_envs: int, **kwargs: Any) -> None:
        import gymnasium as gym

        ensure_registered(env_id)
        self.env = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
            **kwargs,
        )
        space = self.env.single_action_space
        self.num_envs = num_envs
        self.action_shape = tuple(space.shape or ())
        self._start: np.ndarray | None = None  # a discrete space's first value (indexes start at 0)
        if isinstance(space, gym.spaces.Box):
            self.action_low = torch.as_tensor(space.low, dtype=torch.float32)
            self.action_high = torch.as_tensor(space.high, dtype=torch.float32)
        elif isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
            # choices per entry: Discrete's n, MultiDiscrete's nvec, MultiBinary's 2 (its n is its shape)
            per_entry = space.n if isinstance(space, gym.spaces.Discrete) else getattr(space, "nvec", 2)
            choices = np.broadcast_to(per_entry, self.action_shape)
            self._start = np.asarray(getattr(space, "start", 0), dtype=np.int64)
            self.action_choices = tuple(int(c) for c in choices.reshape(-1))
            self.action_low = torch.zeros(self.action_shape, dtype=torch.long)
            self.action_high = torch.as_tensor(choices - 1, dtype=torch.long)
        else:
            self.env.close()
            raise ValueError(
                f"env {env_id!r}: action space {space} is not served (Box, Discrete, MultiDiscrete "
                "or MultiBinary)"
            )
        # the sub-envs' spec: a time limit given in ``kwargs`` (``max_episode_steps``) is theirs,
        # while the vector env's spec keeps the registered one
        envs = getattr(self.env, "envs", None)
        spec = envs[0].spec if envs else self.env.spec
        self.max_episode_steps = spec.max_episode_steps if spec is not None else None

    def reset(self, seed: int | list[int]) -> TensorDict:
        seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else [int(x) for x in seed]
        obs, _ = self.env.reset(seed=seeds)
        return to_tensordict(obs, self.num_envs)

    def step(self, actions: torch.Tensor) -> Step:
        actions = actions.detach().cpu().numpy()
        if self._start is not None:
            actions = actions.astype(np.int64) + self._start
        obs, reward, terminated, truncated, info = self.env.step(actions)
        n = self.num_envs
        done = np.logical_or(terminated, truncated)
        success = np.full(n, np.nan, dtype=np.float32)
        if "is_success" in info:
            success[info["_is_success"]] = info["is_success"][info["_is_success"]]
        final_obs = None
        if done.any():
            final_info = info.get("final_info", {})
            if "is_success" in final_info:
                rows = final_info["_is_success"]
                success[rows] = final_info["is_success"][rows]
            final = to_tensordict(obs, n).clone()
            for i in np.flatnonzero(done):  # info["final_obs"]: one object per env, set where it ended
                last = info["final_obs"][i]
                for key, value in last.items() if isinstance(last, dict) else [("observation", last)]:
                    final[key][int(i)] = _tensor(value)
            final_obs = final
        return Step(
            obs=to_tensordict(obs, n),
            reward=torch.as_tensor(reward, dtype=torch.float32),
            terminated=torch.as_tensor(terminated, dtype=torch.bool),
            truncated=torch.as_tensor(truncated, dtype=torch.bool),
            success=torch.as_tensor(success),
            final_obs=final_obs,
        )

    def close(self) -> None:
        self.env.close()
