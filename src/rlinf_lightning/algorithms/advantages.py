"""Advantage estimators as pure functions of tensors.

:data:`ADVANTAGE_ESTIMATORS` holds the estimators of the reasoning flow by name (an algorithm's
``advantage_estimator`` option picks one; plugins register more). Each is a function
``(inputs, config) -> advantages``: ``inputs`` maps the names it declares with
:func:`~rlinf_lightning.algorithms.contract.reads` to tensors (``rewards [B]``, ``group_ids [B]``,
``token_rewards [B, T]``, ``response_mask [B, T]``, ...), ``config`` is the algorithm object whose
options it reads (e.g. ``scale_std``), and the result is one advantage per sample ``[B]`` or per
token ``[B, T]``.

Each sees a micro-batch of whole prompt groups. What needs the whole rollout batch (REINFORCE++'s
whitening over the batch) is the algorithm's ``norm_adv``, applied by the actor over all of it.
A group of one sample has no baseline to compare with, so the group-relative estimators give it
zero advantage (no signal), as they do a group whose rewards are all equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlinf_lightning.algorithms.contract import reads
from rlinf_lightning.flow.batch import LOSS_MASK, compact, expand
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.registry import Registry

AdvantageEstimator = Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum of its group's ``values`` (float64) and its group's size."""
    if values.shape != group_ids.shape or values.dim() != 1:
        raise ValueError("rewards and group_ids must be 1-D tensors of the same length")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, values.to(torch.float64))
    return sums[inverse], counts[inverse].to(torch.float64)


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; without std scaling, just centred.

    ``group_ids`` labels which prompt each sample answers; groups may arrive in any order. The std
    is the unbiased sample std (as in DeepSeekMath and veRL); a group whose rewards are all equal,
    or a group of one, gets zero advantage, so it contributes no gradient.
    """
    sums, n = _group_sums(rewards, group_ids)
    centred = rewards.to(torch.float64) - sums / n
    squares, _ = _group_sums(centred**2, group_ids)
    std = (squares / (n - 1).clamp_min(1.0)).sqrt()  # a group of one: centred (so adv) is 0 anyway
    adv = centred / (std + eps) if scale_std else centred
    return adv.to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
@reads("rewards", "group_ids")
def grpo_advantages(inputs: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """GRPO's group-normalised advantages (centred; divided by the group std if ``config.scale_std``)."""
    return group_normalized_advantages(
        inputs["rewards"], inputs["group_ids"], scale_std=getattr(config, "scale_std", True)
    )


@ADVANTAGE_ESTIMATORS.register("rloo")
@reads("rewards", "group_ids")
def rloo_advantages(inputs: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): each sample's reward minus the mean of the *other* samples of
    its group, ``A_i = r_i - (sum_g - r_i) / (n - 1)`` (zero for a group of one)."""
    rewards = inputs["rewards"]
    sums, n = _group_sums(rewards, inputs["group_ids"])
    r = rewards.to(torch.float64)
    adv = r - (sums - r) / (n - 1).clamp_min(1.0)
    return torch.where(n > 1, adv, 0.0).to(rewards.dtype)


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{k >= t} gamma^(k-t) r_k`` over each row's generated tokens (zero elsewhere; a
    tool reply between two of them is no step: ``flow.batch.compact``)."""
    r, packed, order = compact(token_rewards * mask, mask)
    out = torch.zeros_like(r)
    following = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        following = r[:, t] + gamma * following
        out[:, t] = following
    return expand(out * packed, mask, order)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@reads("token_rewards", LOSS_MASK)
def reinforce_plus_plus_advantages(inputs: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025): each token's discounted return (``config.gamma``) of the per-token
    rewards, no baseline; the algorithm whitens them over the whole batch (``norm_adv``)."""
    return returns_to_go(inputs["token_rewards"], inputs[LOSS_MASK], getattr(config, "gamma", 1.0))


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@reads("rewards", "group_ids")
def reinforce_plus_plus_baseline_advantages(inputs: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """REINFORCE++-baseline (Hu, 2025): the reward minus its group's mean (no std); the algorithm
    whitens over the whole batch (``norm_adv``)."""
    return group_normalized_advantages(inputs["rewards"], inputs["group_ids"], scale_std=False)


def groups_with_signal(advantages: torch.Tensor, group_ids: torch.Tensor, metrics: Metrics) -> torch.Tensor:
    """Per sample: whether its group carries any signal (some advantage in it is non-zero; a group
    whose rewards are all equal has none, so it adds nothing to the gradient). Records the fraction
    of groups that do in ``metrics`` as ``groups_with_signal``, weighted by the number of groups."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    per_sample = advantages.abs().reshape(len(advantages), -1).sum(-1)  # [B] or [B, T] advantages
    spread = torch.zeros(int(inverse.max()) + 1, dtype=advantages.dtype)
    spread.index_add_(0, inverse, per_sample)
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


def token_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae` over responses (``[B, T]``), each generated token a step: the generated tokens
    (``mask``) are moved to the front first (``flow.batch.compact``; a tool reply between two of
    them is part of the transition, no step), so with rewards and values zeroed behind the last,
    that token bootstraps nothing and the response ends there. ``values[:, t]`` is the critic's
    estimate before token ``t``; returns ``(advantages, returns)``, zero off the mask."""
    mask = mask.to(token_rewards.dtype)
    rewards, packed, order = compact(token_rewards * mask, mask)
    values = (values * mask).gather(-1, order)
    never = torch.zeros(mask.shape, dtype=torch.bool)
    zeros = torch.zeros_like(mask)
    advantages, returns = gae(rewards, values, never, never, zeros, zeros[:, 0], gamma=gamma, lam=lam)
    return expand(advantages * packed, mask, order), expand(returns * packed, mask, order)


@ADVANTAGE_ESTIMATORS.register("gae")
@reads("token_rewards", "values", LOSS_MASK)
def gae_advantages(inputs: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """PPO's token-level GAE (Schulman et al., 2016) with a critic's values: :func:`token_gae` with
    ``config.gamma`` and ``config.gae_lambda``; the critic's targets are these plus its values."""
    advantages, _ = token_gae(
        inputs["token_rewards"],
        inputs["values"],
        inputs[LOSS_MASK],
        gamma=getattr(config, "gamma", 1.0),
        lam=getattr(config, "gae_lambda", 1.0),
    )
    return advantages
