"""Policy losses as pure functions: per-token terms, then one aggregation.

Every loss here returns a **sum** and the **count** it should be divided by. The actor sums these
over all micro-batches of a global batch and divides the accumulated gradient by the total count
once before the optimizer step, so the update is the same whatever the micro-batch size (up to
float summation order). That is what lets a pipelined plan compute the same update as a
collocated one.

:data:`POLICY_LOSSES` holds the per-token policy-gradient terms of the reasoning flow by name (an
algorithm's ``policy_loss`` option picks one; plugins register more): each is a function
``(logprobs, old_logprobs, advantages, mask, config) -> (per_token_loss, metrics)`` over ``[B, T]``
tensors (advantages ``[B, T]`` or ``[B, 1]``), ``config`` being the algorithm object whose options
it reads, declaring what it reads with :func:`~rlinf_lightning.algorithms.contract.reads`. The
algorithm adds its KL and entropy terms and aggregates (``aggregate``).

:data:`OFF_POLICY_CORRECTIONS` holds how a loss treats samples of an older policy (asynchronous
RL, ``trainer.max_staleness``), by name (an algorithm's ``off_policy_correction`` option picks one).
Each is a function ``(CorrectionInputs, config) -> (denominator, weight, metrics)``: the policy loss
takes ``denominator`` as its ratio's, and each token's loss is multiplied by ``weight`` (``None``:
by 1). The behaviour log-probs are the policy's that sampled (the rollout's, possibly versions
old); the proximal ones the actor's before its update (recomputed by the actor, AReaL's pi_prox);
``old`` the ratio's denominator without a correction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from rlinf_lightning.algorithms.contract import reads, reads_of
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.registry import Registry

# the behaviour weight's metric names (logged as they are: ``async/...``)
WEIGHT_METRIC, DROPPED_METRIC = "async/behaviour_weight", "async/behaviour_weight_clipped_frac"

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
#: a correction's answer: the ratio's denominator, the per-token weight (``None``: 1), metrics
Corrected = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


class CorrectionInputs(NamedTuple):
    """What an off-policy correction weighs, per token (``[B, T]``): the learner's log-probs (with
    gradient), the loss's ratio denominator without a correction, the proximal policy's (the actor
    before its update; ``None`` where not computed), the behaviour policy's, and the mask."""

    logprobs: torch.Tensor
    old: torch.Tensor
    proximal: torch.Tensor | None
    behaviour: torch.Tensor
    mask: torch.Tensor


OFF_POLICY_CORRECTIONS: Registry[Callable[[CorrectionInputs, Any], Corrected]] = Registry(
    "off-policy correction"
)


def ppo_clip_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate ``-min(rA, clip(r, 1-lo, 1+hi)A)`` per token; also whether it clipped.

    ``advantages`` broadcasts against ``logprobs`` (e.g. ``[B, 1]`` sequence-level advantages).
    ``dual_clip`` (Ye et al., 2020; > 1, e.g. 3.0) also caps the loss at ``-dual_clip * A`` where
    the advantage is negative, so a huge ratio on a bad action cannot blow the update up.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        capped = torch.minimum(loss, -dual_clip * advantages)
        negative = advantages < 0
        was_clipped = was_clipped | (negative & (capped < loss))
        loss = torch.where(negative, capped, loss)
    return loss, was_clipped.to(logprobs.dtype)


def _clip_range(config: Any) -> tuple[float, float]:
    """``(below, above)`` 1 of the ratio's clip: ``clip_eps`` and ``clip_eps_high`` (or ``clip_eps``)."""
    hi = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    return config.clip_eps, hi


@POLICY_LOSSES.register("ppo_clip")
@reads("old_logprobs", LOSS_MASK)
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token with ``config.clip_eps`` below 1, ``config.clip_eps_high``
    (or ``clip_eps``) above and ``config.dual_clip``; reports the clipped fraction of the tokens."""
    lo, hi = _clip_range(config)
    pg, clipped = ppo_clip_per_token(
        logprobs,
        old_logprobs,
        advantages,
        clip_low=lo,
        clip_high=hi,
        dual_clip=getattr(config, "dual_clip", None),
    )
    return pg, {"clip_frac": masked_mean(clipped, mask).detach()}


@POLICY_LOSSES.register("gspo")
@reads("old_logprobs", LOSS_MASK)
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025): one importance ratio per sequence, the geometric mean of its
    tokens' ``s_i = exp(mean_t(logp - old))`` (length-normalised), clipped per sequence. Per token
    it is GSPO-token's ``s_i,t = sg(s_i) * pi_t / sg(pi_t)``: the value of ``s_i`` and, for a
    sequence-level advantage, its gradient, so a ``seq-mean-token-mean`` aggregation is GSPO's
    sequence objective."""
    m = mask.to(logprobs.dtype)
    log_s = ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
    log_ratio = log_s.detach() + logprobs - logprobs.detach()
    lo, hi = _clip_range(config)
    pg, clipped = ppo_clip_per_token(
        log_ratio, torch.zeros_like(log_ratio), advantages, clip_low=lo, clip_high=hi
    )
    return pg, {"clip_frac": masked_mean(clipped, mask).detach()}


@POLICY_LOSSES.register("cispo")
@reads("old_logprobs", LOSS_MASK)
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1-lo, 1+hi)) * A * logp`` per token. The importance
    weight is clipped, not the update, so every token keeps its gradient (PPO's clip drops the
    low-probability tokens whose ratio left the range)."""
    lo, hi = _clip_range(config)
    ratio = torch.exp(logprobs.detach() - old_logprobs)
    weight = ratio.clamp(1.0 - lo, 1.0 + hi)
    clipped = (weight != ratio).to(logprobs.dtype)
    return -weight * advantages * logprobs, {"clip_frac": masked_mean(clipped, mask).detach()}


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """``0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = V_old + clip(V - V_old, +-clip)``
    (no clipping when ``clip`` is ``None``)."""
    loss = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (v_clipped - returns) ** 2)
    return 0.5 * loss


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): ``exp(d) - d - 1`` with ``d = ref - logp`` (>= 0),
    computed as ``expm1(d) - d`` in float64: in float32, ``exp(d) - 1`` cancels, and a ``d`` at
    rounding level (two computations of the same log-prob, 1e-7 apart) gave -6e-8 a token."""
    d = (ref_logprobs - logprobs).double()
    return (torch.expm1(d) - d).to(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) on samples of pi (Schulman, "Approximating KL
    divergence", 2020): ``k1 = logp - ref`` (unbiased, can be negative), ``k2 = (logp - ref)^2 / 2``
    (biased, low variance), ``k3`` (unbiased, >= 0; :func:`kl_k3`)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: LossAgg, horizon: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce per-token ``values`` under ``mask`` to ``(sum, count)`` for the chosen aggregation.

    * ``token-mean``: every valid token weighs the same (sum of tokens / number of tokens; DAPO).
    * ``seq-mean-token-mean``: mean per sequence, then mean over sequences (GRPO paper).
    * ``seq-mean-token-sum``: sum per sequence, then mean over sequences.
    * ``seq-mean-token-sum-norm``: sum per sequence over the same constant ``horizon`` for every
      sequence (the longest response allowed), then mean: Dr. GRPO's loss, with no length bias.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum(), mask.sum()
    per_seq = (values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not horizon:
            raise ValueError("seq-mean-token-sum-norm needs the horizon (the longest response allowed)")
        per_seq = per_seq / horizon
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_seq.sum(), torch.tensor(float(values.shape[0]), dtype=values.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


# -- off-policy corrections (asynchronous RL) -----------------------------------------------------
def behaviour_weight(proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """``pi_prox / pi_behave`` per token: how much likelier the learner's policy finds the sample
    than the (older) policy that drew it."""
    return torch.exp(proximal - behaviour)


def correct(
    config: Any,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> Corrected:
    """``config.off_policy_correction``'s ``(denominator, weight, metrics)``; raises when it reads
    proximal log-probs that the caller did not compute."""
    correction = OFF_POLICY_CORRECTIONS.get(config.off_policy_correction)
    if "proximal_logprobs" in reads_of(correction) and proximal_logprobs is None:
        raise ValueError(
            f"{config.off_policy_correction} needs proximal_logprobs (the actor's, before its update)"
        )
    inputs = CorrectionInputs(logprobs, old_logprobs, proximal_logprobs, behaviour_logprobs, mask)
    return correction(inputs, config)


def _weight_metrics(
    weight: torch.Tensor, changed: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        WEIGHT_METRIC: masked_mean(weight, mask).detach(),
        DROPPED_METRIC: masked_mean(changed.to(weight.dtype), mask).detach(),
    }


@OFF_POLICY_CORRECTIONS.register("none")
@reads("old_logprobs")
def no_correction(lp: CorrectionInputs, config: Any) -> Corrected:
    """The loss as it is: the ratio against ``old_logprobs``, no weight (exact on-policy at k = 0)."""
    return lp.old, None, {}


@OFF_POLICY_CORRECTIONS.register("decoupled")
@reads("old_logprobs", "proximal_logprobs")
def decoupled_correction(lp: CorrectionInputs, config: Any) -> Corrected:
    """Decoupled PPO (Hilton et al., 2022; AReaL, Fu et al., 2025, arXiv 2505.24298): the ratio is
    ``pi_theta / pi_prox``, clipped around the policy the actor holds (not the stale one that
    sampled), and each token's loss is weighted by ``pi_prox / pi_behave`` truncated at
    ``config.behaviour_weight_cap``, which corrects for the sampler being older."""
    weight = behaviour_weight(lp.proximal, lp.behaviour)
    capped = weight.clamp(max=config.behaviour_weight_cap)
    return lp.proximal, capped, _weight_metrics(weight, capped != weight, lp.mask)


@OFF_POLICY_CORRECTIONS.register("truncated_is")
@reads("old_logprobs")
def truncated_is_correction(lp: CorrectionInputs, config: Any) -> Corrected:
    """Truncated importance sampling (IMPALA, Espeholt et al., 2018): no proximal policy and no
    clip; the policy gradient ``A grad log pi_theta`` is weighted by the truncated importance
    ratio ``min(pi_theta / pi_behave, behaviour_weight_cap)`` (a constant), so a token the learner
    finds far likelier than the sampler did counts at most ``cap`` times. The ratio handed to the
    loss is 1 (the denominator is ``logprobs`` themselves, detached), where PPO's clip is idle."""
    current = lp.logprobs.detach()
    weight = behaviour_weight(current, lp.behaviour)
    capped = weight.clamp(max=config.behaviour_weight_cap)
    return current, capped, _weight_metrics(weight, capped != weight, lp.mask)


@OFF_POLICY_CORRECTIONS.register("mask")
@reads("old_logprobs", "proximal_logprobs")
def mask_correction(lp: CorrectionInputs, config: Any) -> Corrected:
    """Masking (AReaL's behaviour-weight filter; IcePop): decoupled PPO's ratio against the
    proximal policy, and tokens whose behaviour weight ``pi_prox / pi_behave`` lies outside
    ``[1 / cap, cap]`` dropped (weight 0); the others keep their weight."""
    weight = behaviour_weight(lp.proximal, lp.behaviour)
    cap = config.behaviour_weight_cap
    keep = (weight >= 1.0 / cap) & (weight <= cap)
    kept = torch.where(keep, weight, torch.zeros_like(weight))
    return lp.proximal, kept, _weight_metrics(weight, ~keep, lp.mask)
