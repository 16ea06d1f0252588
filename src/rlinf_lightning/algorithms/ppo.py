"""PPO (Schulman et al., 2017) for actor-critic policies: GAE advantages, clipped surrogate with an
optional dual clip, clipped value loss, entropy bonus.

One update, as the embodied workflow runs it (``workflows/embodied.py``):

1. the env and rollout stages collect ``T`` steps of every env (actions, log-probs, values,
   rewards, terminations, truncations with the value of the final observation);
2. ``AdvantageStage`` -> :meth:`PPO.compute_advantages` (:func:`algorithms.advantages.gae`);
3. ``PPOActorStage.end_iteration``: the critic's explained variance of the returns, advantages
   normalised over the whole batch, the proximal log-probs recomputed when the off-policy
   correction reads them (``algorithms.losses.OFF_POLICY_CORRECTIONS``), then ``update_epochs``
   passes over ``num_minibatches`` minibatches, each an optimizer step on :meth:`PPO.loss`
   (``policy.evaluate`` gives new log-probs, entropy and values); with ``target_kl``, no further
   pass once the last minibatch's approximate KL exceeds it (CleanRL's early stop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinf_lightning.algorithms.advantages import gae
from rlinf_lightning.algorithms.contract import Algorithm, reads_of
from rlinf_lightning.algorithms.losses import (
    OFF_POLICY_CORRECTIONS,
    clipped_value_loss,
    correct,
    ppo_clip_per_token,
)


@dataclass
class PPO(Algorithm):
    """Proximal Policy Optimization with a learned value function.

    Args:
        gamma: discount.
        gae_lambda: GAE's lambda.
        clip_eps: ratio clip below 1 (and above, unless ``clip_eps_high``).
        clip_eps_high: ratio clip above 1 (``None``: ``clip_eps``).
        dual_clip: cap of the loss on negative advantages (``None`` disables; RLinf uses 3.0).
        value_clip: clip of the value update around the rollout's values (``None`` disables).
        vf_coef: weight of the value loss.
        ent_coef: weight of the entropy bonus.
        update_epochs: passes over the iteration's samples.
        num_minibatches: optimizer steps per pass.
        norm_adv: normalise advantages over the iteration's batch.
        target_kl: stop the iteration's passes early once the approximate KL of a pass's last
            minibatch to the rollout policy exceeds this (CleanRL's ``target_kl``; ``None``: all
            ``update_epochs`` passes).
        off_policy_correction: how the loss treats samples of an older policy under
            ``trainer.max_staleness``: ``none``, ``decoupled``, ``truncated_is`` or ``mask``
            (``algorithms.losses.OFF_POLICY_CORRECTIONS``; ``docs/async.md``).
        behaviour_weight_cap: the behaviour weight ``pi_prox / pi_behave``'s cap (``decoupled``,
            ``truncated_is``) or range ``[1 / cap, cap]`` (``mask``).
    """

    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    update_epochs: int = 4
    num_minibatches: int = 4
    norm_adv: bool = True
    target_kl: float | None = None
    off_policy_correction: str = "none"
    behaviour_weight_cap: float = 2.0

    needs_reference = False

    @property
    def reads(self) -> frozenset[str]:  # type: ignore[override]
        """What it reads beyond the policy's log-probs (a workflow refuses an algorithm reading
        what it does not provide): each step's reward, the critic's values, where episodes end,
        and what its off-policy correction reads. Option ranges are checked by ``algorithms.options``."""
        correction = OFF_POLICY_CORRECTIONS.get(self.off_policy_correction)
        return frozenset({"rewards", "values", "dones", "old_logprobs"}) | reads_of(correction)

    def problems(self) -> list[tuple[str, str]]:
        """An off-policy correction that is not registered."""
        if self.off_policy_correction in OFF_POLICY_CORRECTIONS:
            return []
        return [("off_policy_correction", OFF_POLICY_CORRECTIONS.unknown_message(self.off_policy_correction))]

    def compute_advantages(
        self,
        rewards: torch.Tensor,
        values: torch.Tensor,
        terminated: torch.Tensor,
        truncated: torch.Tensor,
        final_values: torch.Tensor,
        next_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gae(
            rewards,
            values,
            terminated,
            truncated,
            final_values,
            next_value,
            gamma=self.gamma,
            lam=self.gae_lambda,
        )

    def loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        entropy: torch.Tensor,
        proximal_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss_sum, count, metrics)`` over a minibatch of samples (all tensors ``[B]``);
        ``old_logprobs`` are the behaviour policy's, ``proximal_logprobs`` the actor's before the
        iteration's first step (needed by a correction that reads them)."""
        hi = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        ratio_of, weight, corrected = correct(
            self, logprobs, old_logprobs, proximal_logprobs, old_logprobs, torch.ones_like(logprobs)
        )
        pg, clipped = ppo_clip_per_token(
            logprobs, ratio_of, advantages, clip_low=self.clip_eps, clip_high=hi, dual_clip=self.dual_clip
        )
        if weight is not None:
            pg = pg * weight
        v_loss = clipped_value_loss(values, old_values, returns, self.value_clip)
        per_sample = pg + self.vf_coef * v_loss - self.ent_coef * entropy
        log_ratio = (logprobs - ratio_of).detach()
        metrics = {
            **corrected,
            "pg_loss": pg.detach().mean(),
            "value_loss": v_loss.detach().mean(),
            "entropy": entropy.detach().mean(),
            "clip_frac": clipped.mean(),
            "approx_kl": ((log_ratio.exp() - 1) - log_ratio).mean(),
        }
        return per_sample.sum(), torch.tensor(float(len(per_sample))), metrics
