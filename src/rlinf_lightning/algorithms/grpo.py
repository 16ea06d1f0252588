"""GRPO (Shao et al., 2024, DeepSeekMath): group-relative advantages + PPO-clip + optional KL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinf_lightning.algorithms.advantages import group_normalized_advantages
from rlinf_lightning.algorithms.losses import LossAgg, aggregate, kl_k3, masked_mean, ppo_clip_per_token


@dataclass
class GRPO:
    """Group Relative Policy Optimization.

    Args:
        clip_eps: PPO clip range below 1 (ratio >= 1 - clip_eps).
        clip_eps_high: clip range above 1; ``None`` uses ``clip_eps`` (DAPO's clip-higher sets it larger).
        kl_coef: weight of the k3 KL penalty to the frozen reference policy; 0 disables it and the
            reference forward pass.
        scale_std: divide centred rewards by the group std (``False`` is Dr. GRPO's choice).
        loss_agg: how per-token losses become one number (see ``algorithms.losses.aggregate``).
        tis_cap: truncated importance sampling (Yao et al., 2025) against the rollout engine's
            numeric mismatch (e.g. a bf16 rollout): the PPO ratio is taken against the actor's own
            log-probs before its step (the actor steps once per iteration, so those are the
            behaviour policy as the actor computes it), and each token's loss is weighted by
            ``min(pi_actor / pi_rollout, tis_cap)``. ``None``: the ratio against the rollout's
            log-probs, no weight.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    scale_std: bool = True
    loss_agg: LossAgg = "token-mean"
    tis_cap: float | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return group_normalized_advantages(rewards, group_ids, scale_std=self.scale_std)

    def loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss_sum, count, metrics)`` for one micro-batch; tensors are ``[B, T]``, advantages ``[B]``."""
        hi = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        behaviour = old_logprobs if self.tis_cap is None else logprobs.detach()
        pg, clipped = ppo_clip_per_token(
            logprobs, behaviour, advantages.unsqueeze(-1), clip_low=self.clip_eps, clip_high=hi
        )
        tis = {}
        if self.tis_cap is not None:
            weight = torch.exp(logprobs.detach() - old_logprobs).clamp(max=self.tis_cap)
            pg = pg * weight
            tis = {"tis_weight": masked_mean(weight, mask)}
        per_token = pg
        metrics = {
            "clip_frac": masked_mean(clipped, mask).detach(),
            # KL(rollout policy || actor), k3 estimator on the rollout's samples. The actor steps once
            # per iteration, after the rollout sampled with its weights, so this is the mismatch of the
            # rollout engine's numerics (dtype, kernels) with the actor's
            "approx_kl": masked_mean(kl_k3(old_logprobs, logprobs.detach()), mask),
            **tis,
        }
        if self.needs_reference:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs (the inference stage computes them)")
            kl = kl_k3(logprobs, ref_logprobs)
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = masked_mean(kl, mask).detach()
        loss_sum, count = aggregate(per_token, mask, self.loss_agg)
        return loss_sum, count, metrics
