"""PolicyGradient: an advantage estimator, a policy loss, an aggregation and their options.

The LLM algorithms (``algorithms/presets.py``) are this class with their papers' defaults; users
pick one by name (``trainer.algorithm: dapo``) and override any option key by key. What the
reasoning workflow does with it, per iteration:

1. reward stage: one reward per sample; :meth:`PolicyGradient.shape_rewards` adds DAPO's
   overlong penalty, and a KL penalty when the KL is in the reward (:meth:`token_rewards`);
2. advantage stage: :meth:`compute_advantages` (the estimator, on micro-batches of whole groups);
3. actor: ``norm_adv`` whitens the advantages over the whole rollout batch, then ``ppo_epochs``
   passes over ``num_mini_batches`` mini-batches, each one optimizer step on :meth:`loss`
   against the behaviour log-probs taken before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlinf_lightning.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlinf_lightning.algorithms.contract import Algorithm, reads_of
from rlinf_lightning.algorithms.losses import (
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    aggregate,
    behaviour_weight,
    correct,
    kl_k3,
    kl_penalty,
    masked_mean,
)
from rlinf_lightning.flow.batch import last_loss_token


def adapt_kl_coef(coef: float, kl: float, target: float, horizon: int, samples: int) -> float:
    """Ziegler et al. (2019)'s adaptive KL controller: move ``coef`` so that the measured ``kl``
    approaches ``target``, by at most 20% of the error per ``horizon`` samples."""
    error = max(-0.2, min(0.2, kl / target - 1.0))
    return coef * (1.0 + error * samples / horizon)


def kl_target_problems(algorithm: Any) -> list[tuple[str, str]]:
    """``kl_target`` set while ``kl_coef`` is 0: nothing to adapt (a bad range is its range's problem)."""
    if algorithm.kl_target is not None and algorithm.kl_target > 0 and algorithm.kl_coef <= 0:
        return [("kl_target", "adapts kl_coef, which is 0 (no KL term); set trainer.algorithm.kl_coef > 0")]
    return []


@dataclass
class PolicyGradient(Algorithm):
    """A policy-gradient algorithm for LLMs (no critic).

    Args:
        advantage_estimator: the ``ADVANTAGE_ESTIMATORS`` entry (``grpo``, ``rloo``,
            ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``; plugins add more).
        policy_loss: the ``POLICY_LOSSES`` entry (``ppo_clip``, ``gspo``, ``cispo``; plugins add more).
        loss_agg: how per-token losses become one number: ``token-mean``, ``seq-mean-token-mean``,
            ``seq-mean-token-sum`` or ``seq-mean-token-sum-norm`` (``algorithms.losses.aggregate``).
        clip_eps: the ratio's clip range below 1.
        clip_eps_high: the clip range above 1; ``None``: ``clip_eps`` (DAPO's clip-higher sets it larger).
        dual_clip: cap the loss of a negative advantage at ``-dual_clip * A`` (> 1; ``None``: no cap).
        scale_std: ``grpo`` estimator: divide centred rewards by the group std (``False``: Dr. GRPO).
        norm_adv: whiten the advantages over the whole rollout batch (REINFORCE++).
        gamma: discount of per-token rewards (``reinforce_plus_plus``).
        kl_coef: weight of the KL to the frozen reference policy; 0 disables it and the
            reference forward pass.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (``algorithms.losses.kl_penalty``).
        kl_in_reward: subtract the KL from the rewards, per token, instead of adding it to the loss.
        kl_target: adapt ``kl_coef`` each iteration towards this KL per token (``None``: fixed).
        kl_horizon: samples over which the adaptive coefficient corrects 20% of its error.
        entropy_coef: weight of an entropy bonus (subtracted from the loss; 0: none).
        tis_cap: truncated importance sampling (Yao et al., 2025) against the rollout engine's
            numeric mismatch (e.g. a bf16 rollout): the ratio is against the actor's own log-probs
            taken before its first step, and each token's loss is weighted by
            ``min(pi_actor / pi_rollout, tis_cap)``. ``None``: the ratio against the rollout's
            log-probs when the actor steps once per rollout batch, no weight.
        off_policy_correction: how the loss treats samples of an older policy under
            ``trainer.max_staleness`` (the ``OFF_POLICY_CORRECTIONS`` entry): ``none`` (the loss as
            it is), ``decoupled`` (AReaL's decoupled PPO), ``truncated_is`` or ``mask``
            (``docs/async.md``).
        behaviour_weight_cap: the behaviour weight ``pi_prox / pi_behave``'s cap (``decoupled``,
            ``truncated_is``) or range ``[1 / cap, cap]`` (``mask``).
        ppo_epochs: passes over each rollout batch.
        num_mini_batches: optimizer steps per pass (whole prompt groups each; must divide the
            prompts per iteration).
        overlong_buffer: DAPO's soft overlong punishment: the last ``overlong_buffer`` fraction of
            ``task.sampling.max_new_tokens`` is a buffer in which the reward falls linearly by up
            to ``overlong_penalty`` (0: off).
        overlong_penalty: the penalty at the longest response allowed.
        max_sampling_rounds: DAPO's dynamic sampling: a prompt whose group's rewards are all
            equal is replaced by the next prompt of its own reserve stream, up to this many
            rounds, so the batch fills with groups that carry signal (0: off).
    """

    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token-mean"  # a LossAgg; checked by algorithms.options with the other ranges
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    scale_std: bool = True
    norm_adv: bool = False
    gamma: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    kl_target: float | None = None
    kl_horizon: int = 10000
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    off_policy_correction: str = "none"
    behaviour_weight_cap: float = 2.0
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0
    max_sampling_rounds: int = 0

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return self.kl_coef > 0

    @property
    def updates_per_batch(self) -> int:
        return self.ppo_epochs * self.num_mini_batches

    @property
    def reads(self) -> frozenset[str]:  # type: ignore[override]
        """The inputs its estimator, its loss and its KL term read (``algorithms.contract``)."""
        out = set(reads_of(ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)))
        out |= reads_of(POLICY_LOSSES.get(self.policy_loss))
        out |= reads_of(OFF_POLICY_CORRECTIONS.get(self.off_policy_correction))
        if self.needs_reference:
            out.add("ref_logprobs")
        return frozenset(out)

    def problems(self) -> list[tuple[str, str]]:
        """``(option, problem)`` for names not registered and options that contradict each other
        (ranges are checked by ``algorithms.options``)."""
        p = [
            (key, registry.unknown_message(getattr(self, key)))
            for key, registry in (
                ("advantage_estimator", ADVANTAGE_ESTIMATORS),
                ("policy_loss", POLICY_LOSSES),
                ("off_policy_correction", OFF_POLICY_CORRECTIONS),
            )
            if getattr(self, key) not in registry
        ]
        corrects = (
            self.off_policy_correction in OFF_POLICY_CORRECTIONS and self.off_policy_correction != "none"
        )
        if corrects and self.tis_cap is not None and self.tis_cap > 0:  # (else a name or range says)
            p.append(
                (
                    "tis_cap",
                    f"weights tokens like off_policy_correction={self.off_policy_correction!r} does; "
                    "set one of them (tis_cap: null, or off_policy_correction: none)",
                )
            )
        return p + kl_target_problems(self)

    # -- rewards and advantages ------------------------------------------------------------------
    def overlong_penalty_of(self, lengths: torch.Tensor, horizon: int) -> torch.Tensor:
        """DAPO's soft overlong punishment per sample (<= 0): 0 up to ``horizon - buffer`` tokens,
        then falling linearly to ``-overlong_penalty`` at ``horizon`` (``buffer`` being
        ``overlong_buffer x horizon`` tokens)."""
        buffer = self.overlong_buffer * horizon
        if buffer <= 0:
            return torch.zeros_like(lengths, dtype=torch.float32)
        excess = (lengths.float() - (horizon - buffer)).clamp(min=0.0, max=buffer)
        return -self.overlong_penalty * excess / buffer

    def token_rewards(
        self, rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float
    ) -> torch.Tensor:
        """Per-token rewards ``[B, T]``: each sample's reward on its last response token, minus
        ``kl_coef x kl`` on every token when the KL is in the reward (``kl`` per token, or ``None``)."""
        out = torch.zeros(mask.shape, dtype=torch.float32)
        out[torch.arange(len(rewards)), last_loss_token(mask)] = rewards.float()  # holes: tool replies
        if kl is not None:
            out = out - kl_coef * kl * mask
        return out * mask

    def compute_advantages(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The estimator's advantages (``[B]`` or ``[B, T]``) from ``inputs`` (``algorithms.contract``)."""
        return ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)(inputs, self)

    # -- the loss --------------------------------------------------------------------------------
    def loss(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
        *,
        rollout_logprobs: torch.Tensor | None = None,
        proximal_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        kl_coef: float | None = None,
        horizon: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss_sum, count, metrics)`` for one micro-batch; tensors are ``[B, T]``, advantages
        ``[B]``, ``[B, 1]`` or ``[B, T]``.

        ``old_logprobs`` are the behaviour policy's (the ratio's denominator); with ``tis_cap``,
        ``rollout_logprobs`` are the rollout engine's, weighted against. The off-policy correction
        may replace the denominator and weight each token (``algorithms.losses``), from the
        rollout's log-probs (else ``old_logprobs``) as the behaviour policy's and
        ``proximal_logprobs``, the actor's before its update. ``entropy`` (per token,
        with its gradient) is needed for an entropy bonus; ``kl_coef`` overrides the option (an
        adaptive coefficient's current value); ``horizon`` is the longest response allowed (for
        ``seq-mean-token-sum-norm``)."""
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)
        behaviour = old_logprobs if rollout_logprobs is None else rollout_logprobs
        ratio_of, behaviour_w, corrected = correct(
            self, logprobs, old_logprobs, proximal_logprobs, behaviour, mask
        )
        pg, metrics = POLICY_LOSSES.get(self.policy_loss)(logprobs, ratio_of, advantages, mask, self)
        metrics.update(corrected)
        if behaviour_w is not None:
            pg = pg * behaviour_w
        if self.tis_cap is not None:
            if rollout_logprobs is None:
                raise ValueError("tis_cap needs rollout_logprobs (the rollout engine's)")
            weight = behaviour_weight(old_logprobs, rollout_logprobs).clamp(max=self.tis_cap)
            pg = pg * weight
            metrics["tis_weight"] = masked_mean(weight, mask)
        # KL(rollout policy || actor), k3 on the rollout's samples: the rollout engine's numeric
        # mismatch, plus, after the first of several steps per batch, how far the steps moved the actor
        sampler = old_logprobs if rollout_logprobs is None else rollout_logprobs
        metrics["approx_kl"] = masked_mean(kl_k3(sampler, logprobs.detach()), mask)
        per_token = pg
        if self.needs_reference and not self.kl_in_reward:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs (the inference stage computes them)")
            kl = kl_penalty(logprobs, ref_logprobs, self.kl_estimator)
            per_token = per_token + (self.kl_coef if kl_coef is None else kl_coef) * kl
            metrics["kl"] = masked_mean(kl, mask).detach()
        if self.entropy_coef > 0:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs the per-token entropy (with its gradient)")
            per_token = per_token - self.entropy_coef * entropy
        loss_sum, count = aggregate(per_token, mask, self.loss_agg, horizon)
        return loss_sum, count, metrics
