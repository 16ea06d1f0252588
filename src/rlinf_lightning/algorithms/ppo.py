"""PPO (Schulman et al., 2017) for actor-critic policies: GAE advantages, clipped surrogate with an
optional dual clip, clipped value loss, entropy bonus.

One update, as the embodied workflow runs it (``workflows/embodied/``):

1. the env and rollout stages collect ``T`` steps of every env (actions, log-probs, values,
   rewards, terminations, truncations with the value of the final observation);
2. ``AdvantageStage`` -> :meth:`PPO.compute_advantages` (:func:`algorithms.advantages.gae`);
3. ``PPOActorStage.end_iteration``: the critic's explained variance of the returns, advantages
   normalised over the whole batch, the proximal log-probs recomputed when the off-policy
   correction reads them (``algorithms.losses.OFF_POLICY_CORRECTIONS``), then ``update_epochs``
   passes over ``num_minibatches`` minibatches, each an optimizer step on :meth:`PPO.loss`
   (``policy.evaluate`` gives new log-probs, entropy and values); with ``target_kl``, no further
   pass once the last minibatch's approximate KL exceeds it (CleanRL's early stop).

On a language model (``workflows/reasoning/``, with a critic: ``task.critic``) the same options
run token-level PPO as InstructGPT (Ouyang et al., 2022) does, through :meth:`PPO.on_tokens`:

1. the critic stage (``workflows/critic.py``) estimates each response token's value, puts the
   outcome reward on the last response token (minus ``kl_coef`` x the per-token KL to the
   reference when the KL is in the reward) and computes GAE over the tokens
   (:func:`algorithms.advantages.token_gae`); its targets are the advantages plus its values;
2. the actor whitens the advantages over the rollout batch and takes ``update_epochs`` x
   ``num_minibatches`` optimizer steps on the clipped surrogate per token; the critic takes as
   many on the clipped value loss (:func:`algorithms.losses.clipped_value_loss`), with its own
   optimizer; for the first ``critic_warmup`` iterations only the critic trains.
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
    kl_k3,
    ppo_clip_per_token,
)
from rlinf_lightning.algorithms.policy_gradient import PolicyGradient, kl_target_problems


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
            ``update_epochs`` passes). Env steps only.
        off_policy_correction: how the loss treats samples of an older policy under
            ``trainer.max_staleness``: ``none``, ``decoupled``, ``truncated_is`` or ``mask``
            (``algorithms.losses.OFF_POLICY_CORRECTIONS``; ``docs/async.md``).
        behaviour_weight_cap: the behaviour weight ``pi_prox / pi_behave``'s cap (``decoupled``,
            ``truncated_is``) or range ``[1 / cap, cap]`` (``mask``).

    On tokens only (a language model with a critic):

    Args:
        kl_coef: weight of the KL to the frozen reference policy (0: none, and no reference
            forward pass; InstructGPT: 0.02, in the reward).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (``algorithms.losses.kl_penalty``).
        kl_in_reward: subtract the KL from each token's reward (InstructGPT) instead of adding it
            to the loss.
        kl_target: adapt ``kl_coef`` each iteration towards this KL per token (Ziegler et al.,
            2019; ``None``: fixed).
        kl_horizon: samples over which the adaptive coefficient corrects 20% of its error.
        loss_agg: how per-token losses become one number (``algorithms.losses.aggregate``).
        critic_warmup: iterations at the start in which only the critic trains (the actor takes
            no step), so the first advantages come from a critic that has seen some returns.
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
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    kl_in_reward: bool = True
    kl_target: float | None = None
    kl_horizon: int = 10000
    loss_agg: str = "token-mean"
    critic_warmup: int = 0
    off_policy_correction: str = "none"
    behaviour_weight_cap: float = 2.0

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return self.kl_coef > 0

    @property
    def reads(self) -> frozenset[str]:  # type: ignore[override]
        """What it reads beyond the policy's log-probs (a workflow refuses an algorithm reading
        what it does not provide): each step's reward, the critic's values, where episodes end,
        the reference's log-probs with a KL term, and what its off-policy correction reads. Option
        ranges: ``algorithms.options``."""
        correction = OFF_POLICY_CORRECTIONS.get(self.off_policy_correction)
        out = {"rewards", "values", "dones", "old_logprobs"} | reads_of(correction)
        return frozenset(out | {"ref_logprobs"} if self.needs_reference else out)

    def problems(self) -> list[tuple[str, str]]:
        """Options that contradict each other or name nothing registered (ranges are checked by
        ``algorithms.options``)."""
        p = kl_target_problems(self)
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            unknown = OFF_POLICY_CORRECTIONS.unknown_message(self.off_policy_correction)
            p.append(("off_policy_correction", unknown))
        return p

    def on_tokens(self) -> TokenPPO:
        """These options as the reasoning workflow runs them: one step per response token."""
        return TokenPPO(
            gamma=self.gamma,
            gae_lambda=self.gae_lambda,
            clip_eps=self.clip_eps,
            clip_eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            value_clip=self.value_clip,
            vf_coef=self.vf_coef,
            entropy_coef=self.ent_coef,
            ppo_epochs=self.update_epochs,
            num_mini_batches=self.num_minibatches,
            norm_adv=self.norm_adv,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            kl_in_reward=self.kl_in_reward,
            kl_target=self.kl_target,
            kl_horizon=self.kl_horizon,
            loss_agg=self.loss_agg,
            critic_warmup=self.critic_warmup,
            off_policy_correction=self.off_policy_correction,
            behaviour_weight_cap=self.behaviour_weight_cap,
        )

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
        """``(loss_sum, count, metrics)`` over a minibatch of samples (tensors ``[B]``);
        ``old_logprobs`` are the behaviour policy's, ``proximal_logprobs`` the actor's before the
        iteration's first step (needed by a correction that reads them).

        Log-probs may also be ``[B, N]``: a policy whose action's log-prob factorises over ``N``
        entries (π0's chunk, ``Pi0Policy(logprob_level="entry")``) gets a ratio and a clip per
        entry, the sample's advantage broadcast, and the sample's loss is their mean (RLinf's
        ``logprob_type: token_level``): one entry's ratio leaving the trust region no longer
        stops the gradient of all the others."""
        hi = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        ratio_of, weight, corrected = correct(
            self, logprobs, old_logprobs, proximal_logprobs, old_logprobs, torch.ones_like(logprobs)
        )
        per_entry = advantages.view(-1, *[1] * (logprobs.dim() - 1))
        pg, clipped = ppo_clip_per_token(
            logprobs, ratio_of, per_entry, clip_low=self.clip_eps, clip_high=hi, dual_clip=self.dual_clip
        )
        if weight is not None:
            pg = pg * weight
        pg = pg.flatten(1).mean(-1) if pg.dim() > 1 else pg
        v_loss = clipped_value_loss(values, old_values, returns, self.value_clip)
        per_sample = pg + self.vf_coef * v_loss - self.ent_coef * entropy
        metrics = {
            **corrected,
            "pg_loss": pg.detach().mean(),
            "value_loss": v_loss.detach().mean(),
            "entropy": entropy.detach().mean(),
            "clip_frac": clipped.mean(),
            "approx_kl": kl_k3(ratio_of, logprobs.detach()).mean(),  # CleanRL's (ratio - 1) - log ratio
        }
        return per_sample.sum(), torch.tensor(float(len(per_sample))), metrics


@dataclass
class TokenPPO(PolicyGradient):
    """PPO on a language model's tokens (:meth:`PPO.on_tokens`): the ``gae`` estimator over the
    critic's per-token values and the clipped surrogate per token, plus what the critic stage
    reads: ``gae_lambda``, ``value_clip``, ``vf_coef`` (the critic's loss weight) and
    ``critic_warmup`` (see :class:`PPO` for each)."""

    advantage_estimator: str = "gae"
    gae_lambda: float = 0.95
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    critic_warmup: int = 0
