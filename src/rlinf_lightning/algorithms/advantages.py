"""Advantage estimators as pure functions of tensors."""

from __future__ import annotations

import torch


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
