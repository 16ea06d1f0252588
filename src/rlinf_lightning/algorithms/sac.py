"""Off-policy actor-critic: SAC (Haarnoja et al., 2018), and RLPD (Ball et al., 2023) and CrossQ
(Bhatt et al., 2024) on top of it.

One update on a batch of transitions ``(s, a, r, s', d)`` (``d``: the step *terminated* the
episode, 0 with ``bootstrap_at_termination``; a truncation bootstraps), with ``E`` critics
``Q_1..Q_E``, their Polyak-averaged targets ``Q'_i``, a tanh-squashed Gaussian actor ``pi`` and
the temperature ``alpha = exp(log_alpha)``:

    a' ~ pi(.|s'),    y = r + gamma (1 - d) (min_{i in K} Q'_i(s', a') - alpha log pi(a'|s'))
    L_Q     = sum_i mean_batch (Q_i(s, a) - y)^2
    L_pi    = mean_batch (alpha log pi(a~|s) - agg_i Q_i(s, a~)),     a~ ~ pi(.|s)
    L_alpha = mean_batch (-log_alpha (log pi(a~|s) + H_target)),       H_target = -|A|
    Q'_i <- tau Q_i + (1 - tau) Q'_i               after every step (``policies.sac.polyak``)

SAC: two critics, ``K`` both of them, ``agg`` the minimum. RLPD: ``E`` = 10 LayerNorm critics
(the policy's ``num_critics`` and ``layer_norm``), ``K`` a random pair drawn per update
(``critic_subset``), ``agg`` the mean, half of every batch from demonstrations (``demo_ratio``)
and 20 updates per env step (``updates_per_step``).

The three losses are summed into one and taken by one optimizer whose parameter groups are the
actor, the critics and the temperature: each loss reaches only its own group (the actor's loss
reads the critics through detached weights, the temperature's a detached log-prob), and Adam is
per parameter, so this is the three optimizers' step, with the actor and the temperature seeing
the critics from before this step's update (as in JAX implementations that update jointly). With
``policy_delay`` d the actor and temperature losses join only every d-th update (their groups get
no gradient, so Adam leaves them and their moments alone in between).

CrossQ drops the targets: the critics are batch-normalized (``policies.CrossQPolicy``) and
``(s, a)`` and ``(s', a')`` go through them as one batch of ``2B``, so the normalization's batch
statistics cover both distributions, the next values taken with a stop-gradient:

    [Q_i(s, a); Q_i(s', a')] = Q_i([s; s'], [a; a'])      one forward, batch statistics of both
    y = r + gamma (1 - d) sg(min_{i in K} Q_i(s', a') - alpha log pi(a'|s'))
    L_pi, L_alpha as above every 3rd update, Q_i(s, a~) read with the running statistics
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rlinf_lightning.algorithms.contract import Algorithm


def critic_target(
    reward: torch.Tensor,
    terminated: torch.Tensor,
    next_q: torch.Tensor,
    next_logprob: torch.Tensor,
    alpha: torch.Tensor | float,
    gamma: float,
) -> torch.Tensor:
    """``y = r + gamma (1 - d) (next_q - alpha log pi(a'|s'))`` per transition (``[B]``)."""
    return reward + gamma * (1.0 - terminated.float()) * (next_q - alpha * next_logprob)


def critic_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``sum_i mean_b (Q_i - y)^2`` of ``q`` ``[E, B]`` against ``target`` ``[B]``."""
    return ((q - target.detach()) ** 2).mean(-1).sum()


def actor_loss(logprob: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """``mean_b (alpha log pi(a~|s) - q)`` with ``q`` the critics' aggregate at ``a~`` (``[B]``)."""
    return (alpha * logprob - q).mean()


def temperature_loss(log_alpha: torch.Tensor, logprob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """``mean_b (-log_alpha (log pi + H_target))``: raises alpha while the entropy is below target."""
    return (-log_alpha * (logprob.detach() + target_entropy)).mean()


@dataclass
class SAC(Algorithm):
    """Soft Actor-Critic with automatic temperature, over a replay buffer (``workflows/offpolicy``).

    Args:
        gamma: discount per policy call.
        tau: Polyak rate of the target critics (after every update).
        batch_size: transitions per update.
        buffer_capacity: transitions the replay buffer holds (the oldest are replaced).
        learning_starts: transitions collected before the first update.
        updates_per_step: updates per transition collected (the update-to-data ratio, UTD).
        target_entropy: the entropy the temperature steers to (``None``: ``-|A|``, minus the
            action entries per policy call).
        init_alpha: the temperature at the start.
        critic_subset: critics whose minimum makes the target (``None``: all of them).
        actor_aggregate: how the actor's loss combines the critics: ``min`` or ``mean``.
        demo_path: demonstrations (``rlinf demos``) loaded into a second buffer (``None``: none).
        demo_ratio: the share of every batch drawn from the demonstrations.
        policy_delay: updates per actor (and temperature) update; the critics learn at every one.
        bootstrap_at_termination: bootstrap at a termination too, as at a truncation (ManiSkill's
            SAC baseline's ``bootstrap_at_done="always"``). For a task that ends an episode at
            success and pays a dense reward bounded by the success reward (ManiSkill's
            ``normalized_dense``: at most 1 a step), stopping the bootstrap there values success
            at one step's reward while hovering next to it earns up to ``1 / (1 - gamma)``: the
            policy learns to approach the goal and never reach it.
    """

    gamma: float = 0.99
    tau: float = 0.005
    batch_size: int = 256
    buffer_capacity: int = 1_000_000
    learning_starts: int = 5_000
    updates_per_step: float = 1.0
    target_entropy: float | None = None
    init_alpha: float = 1.0
    critic_subset: int | None = None
    actor_aggregate: str = "min"
    demo_path: str | None = None
    demo_ratio: float = 0.0
    policy_delay: int = 1
    bootstrap_at_termination: bool = False

    #: whether the critics' targets are Polyak-averaged copies (``policy.update_targets``)
    target_critics: ClassVar[bool] = True
    #: what the off-policy workflow gives it: transitions, not advantages
    reads = frozenset({"rewards", "dones"})

    def problems(self) -> list[tuple[str, str]]:
        """What the shared option table cannot say: sizes relative to each other."""
        out = []
        if 1 <= self.buffer_capacity < self.batch_size:
            why = f"{self.batch_size} transitions per batch, more than buffer_capacity={self.buffer_capacity}"
            out.append(("batch_size", why))
        if self.demo_ratio > 0 and self.demo_path is None:
            out.append(("demo_path", f"demo_ratio={self.demo_ratio} draws demonstrations: name their file"))
        return out


@dataclass
class RLPD(SAC):
    """RLPD (Ball et al., 2023): SAC with symmetric sampling (half of each batch from
    demonstrations), a random pair of an ensemble of LayerNorm critics for the target, the
    ensemble's mean for the actor, and a high update-to-data ratio. The ensemble and LayerNorm
    are the policy's (``SACPolicy(num_critics=10, layer_norm=True)``)."""

    updates_per_step: float = 20.0
    critic_subset: int | None = 2
    actor_aggregate: str = "mean"
    demo_ratio: float = 0.5
    init_alpha: float = 0.1
    learning_starts: int = 0


@dataclass
class CrossQ(SAC):
    """CrossQ (Bhatt et al., ICLR 2024): SAC without target critics, batch-normalized critics that
    see ``(s, a)`` and ``(s', a')`` in one forward, one update per env step and the actor updated
    every third one; Adam's betas (0.5, 0.999) and the wider critics are the policy's
    (``CrossQPolicy``). ``tau`` is unused: there is no target to move."""

    policy_delay: int = 3

    target_critics: ClassVar[bool] = False
