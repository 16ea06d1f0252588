"""GRPO (Shao et al., 2024, DeepSeekMath): group-relative advantages + PPO-clip + optional KL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinf_lightning.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlinf_lightning.algorithms.losses import POLICY_LOSSES, LossAgg, aggregate, kl_k3, masked_mean


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
        advantage_estimator: the ``ADVANTAGE_ESTIMATORS`` entry turning a group's rewards into
            advantages (``grpo``; plugins add more).
        policy_loss: the ``POLICY_LOSSES`` entry giving the per-token policy-gradient term
            (``ppo_clip``; plugins add more).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    scale_std: bool = True
    loss_agg: LossAgg = "token-mean"
    tis_cap: float | None = None
    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def reads(self) -> frozenset[str]:
        """What it reads beyond the policy's log-probs (a workflow refuses an algorithm reading what
        it does not provide): rewards compared within groups, masks, and with a KL term the
        reference policy's log-probs."""
        reference = {"ref_logprobs"} if self.needs_reference else set()
        return frozenset({"rewards", "group_ids", "masks", "old_logprobs", *reference})

    def problems(self) -> list[tuple[str, str]]:
        """``(option, problem)`` pairs for options out of range or names not registered."""
        p = [
            (key, f"must be >= 0, got {getattr(self, key)}")
            for key in ("clip_eps", "clip_eps_high", "kl_coef")
            if getattr(self, key) is not None and getattr(self, key) < 0
        ]
        if self.tis_cap is not None and self.tis_cap <= 0:
            p.append(("tis_cap", f"must be > 0 or null (no correction), got {self.tis_cap}"))
        for key, registry in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
            if getattr(self, key) not in registry:
                p.append((key, registry.unknown_message(getattr(self, key))))
        return p

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)(rewards, group_ids, self)

    def loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss_sum, count, metrics)`` for one micro-batch; tensors are ``[B, T]``, advantages ``[B]``."""
        behaviour = old_logprobs if self.tis_cap is None else logprobs.detach()
        pg, loss_metrics = POLICY_LOSSES.get(self.policy_loss)(
            logprobs, behaviour, advantages.unsqueeze(-1), mask, self
        )
        tis = {}
        if self.tis_cap is not None:
            weight = torch.exp(logprobs.detach() - old_logprobs).clamp(max=self.tis_cap)
            pg = pg * weight
            tis = {"tis_weight": masked_mean(weight, mask)}
        per_token = pg
        metrics = {
            **loss_metrics,
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
