"""Advantage estimators as pure functions of tensors.

:data:`ADVANTAGE_ESTIMATORS` holds the outcome-level estimators of the reasoning flow by name (an
algorithm's ``advantage_estimator`` option picks one; plugins register more): each is a function
``(rewards [B], group_ids [B], config) -> advantages [B]``, ``config`` being the algorithm object
whose options it reads (e.g. ``scale_std``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.registry import Registry

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; without std scaling, just centred.

    ``group_ids`` labels which prompt each sample answers; groups may arrive in any order. The std
    is the unbiased sample std (as in DeepSeekMath and veRL); a group whose rewards are all equal
    gets zero advantage, so it contributes no gradient.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError("rewards and group_ids must be 1-D tensors of the same length")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError("every group needs at least 2 samples to normalise advantages")
    r = rewards.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, r)
    means = sums / counts
    centred = r - means[inverse]
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = (sq / (counts - 1)).sqrt()
    adv = centred / (std[inverse] + eps) if scale_std else centred
    return adv.to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """GRPO's group-normalised advantages (centred; divided by the group std if ``config.scale_std``)."""
    return group_normalized_advantages(rewards, group_ids, scale_std=getattr(config, "scale_std", True))


def groups_with_signal(advantages: torch.Tensor, group_ids: torch.Tensor, metrics: Metrics) -> torch.Tensor:
    """Per sample: whether its group carries any signal (some advantage in it is non-zero; a group
    whose rewards are all equal has none, so it adds nothing to the gradient). Records the fraction
    of groups that do in ``metrics`` as ``groups_with_signal``, weighted by the number of groups."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    spread = torch.zeros(int(inverse.max()) + 1, dtype=advantages.dtype)
    spread.index_add_(0, inverse, advantages.abs())
    signal = spread > 0
    metrics.mean("groups_with_signal", float(signal.float().mean()), len(signal))
    return signal[inverse]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    next_value: torch.Tensor,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over ``[N, T]`` trajectories; returns ``(advantages, returns)``.

    Step ``t`` ends an episode when ``terminated`` (bootstrap 0: nothing follows a terminal state)
    or ``truncated`` (bootstrap ``gamma * final_values[:, t]``, the value of the episode's last
    observation, since a time limit is not the end of the task); the recursion restarts after
    either. Otherwise the next state's value is ``values[:, t + 1]``, or ``next_value`` after the
    last step::

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
        R_t     = A_t + V(s_t)
    """
    n, t_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    following = torch.zeros(n, dtype=rewards.dtype)
    for t in reversed(range(t_len)):
        next_v = next_value if t == t_len - 1 else values[:, t + 1]
        done = terminated[:, t] | truncated[:, t]
        bootstrap = torch.where(truncated[:, t], final_values[:, t], next_v)
        bootstrap = torch.where(terminated[:, t], torch.zeros_like(bootstrap), bootstrap)
        delta = rewards[:, t] + gamma * bootstrap - values[:, t]
        following = delta + gamma * lam * (~done).to(rewards.dtype) * following
        advantages[:, t] = following
    return advantages, advantages + values
