"""Environments: a batch of simulators stepped together, with tensors in and out.

Every environment reaches the workflow through one small contract, :class:`EnvBatch`, so the env
stage never learns which simulator it drives: gymnasium vector envs (built in: any gymnasium id),
ManiSkill3 and LIBERO (plugins) all adapt to it. Observations are a ``TensorDict`` of batch
``[num_envs]`` (state vectors as float32, images as uint8 ``[H, W, C]``, an instruction as a
string entry where the task has one). Episodes reset themselves: where one ended at a step, that
step's ``obs`` is already the new episode's first observation and ``final_obs`` holds the last one
of the ended episode, so a value function can bootstrap on truncation.

Factories are registered by name in :data:`ENVS` (plugins add theirs through the
``rlinf_lightning.plugins`` entry point); a name that is not registered is taken as a gymnasium id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlinf_lightning.registry import Registry


@dataclass
class Step:
    """What one step of every environment returns (all tensors of batch ``[num_envs]``).

    Attributes:
        obs: next observations; the reset observation where an episode ended.
        reward: float32 rewards.
        terminated: episodes that ended in a terminal state (no bootstrap).
        truncated: episodes cut by a time limit (bootstrap from ``final_obs``).
        success: 1.0 where the env reports success at this step (for an ended episode: at its last
            step), 0.0 where it reports none; NaN when the env has no notion of success.
        final_obs: the last observation of each ended episode (rows where ``terminated |
            truncated``; other rows are copies of ``obs``), or ``None`` when no episode ended.
    """

    obs: TensorDict
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    final_obs: TensorDict | None = None


class EnvBatch(ABC):
    """``num_envs`` environments stepped together (see the module docstring).

    Attributes:
        num_envs: how many environments.
        action_shape: the shape of one environment's action, in ``[action_low, action_high]``.
        action_low / action_high: tensors of ``action_shape``: float32 for continuous actions;
            int64 ``0`` and ``choices - 1`` for discrete ones.
        action_choices: ``None`` for continuous actions; for discrete ones, the number of
            choices of each action entry in row-major order (``Discrete(n)``: ``(n,)`` with
            ``action_shape`` ``()``), an action entry being an int64 index in ``[0, choices)``
            (the adapter adds a space's ``start``).
        max_episode_steps: the time limit of an episode, when the env has one.
    """

    num_envs: int
    action_shape: tuple[int, ...]
    action_low: torch.Tensor
    action_high: torch.Tensor
    action_choices: tuple[int, ...] | None = None
    max_episode_steps: int | None = None

    @abstractmethod
    def reset(self, seed: int | list[int]) -> TensorDict:
        """Start a new episode in every environment: env ``i`` seeded with ``seed + i``, or with
        ``seed[i]`` when given one seed per env (envs of a GRPO group share theirs)."""

    @abstractmethod
    def step(self, actions: torch.Tensor) -> Step:
        """Apply ``actions`` (``[num_envs, *action_shape]``, clipped to the bounds by the caller)."""

    def close(self) -> None:
        """Release the simulators."""


EnvFactory = Callable[..., EnvBatch]
ENVS: Registry[EnvFactory] = Registry("env")
