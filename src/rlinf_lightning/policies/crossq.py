"""CrossQPolicy: SACPolicy's actor with CrossQ's critics (Bhatt et al., ICLR 2024): batch
normalization on the input and after every hidden layer, wider by default, and no target critics.

The paper normalizes with Batch Renormalization; this is plain ``BatchNorm1d`` (eps 1e-3,
momentum 0.01, the paper's 0.99 in the other convention). The reference implementations
(sb3-contrib, SBX) run Batch Renormalization as plain batch normalization for its first 100,000
training steps (their ``warmup_steps``), so for runs of up to 100k updates the training passes are
the same; after that, Batch Renormalization would also correct each batch towards the running
statistics. The critics normalize with the batch's statistics when learning (the learner passes
``(s, a)`` and ``(s', a')`` as one batch, so both are covered), with the running ones when the
actor's loss reads them (``frozen``), as sb3-contrib's CrossQ does.
"""

from __future__ import annotations

import torch
from torch import nn

from rlinf_lightning.policies.sac import EnsembleLinear, SACPolicy


class EnsembleBatchNorm(nn.BatchNorm1d):
    """``BatchNorm1d`` per member and feature of ``[members, B, features]``: statistics over ``B``."""

    def __init__(self, members: int, features: int, momentum: float) -> None:
        super().__init__(members * features, eps=1e-3, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members, b, features = x.shape
        flat = super().forward(x.transpose(0, 1).reshape(b, members * features))
        return flat.reshape(b, members, features).transpose(0, 1)


class CrossQPolicy(SACPolicy):
    """A squashed-Gaussian actor (``hidden_sizes``) with ``num_critics`` batch-normalized critics
    (``critic_hidden_sizes``) and no targets, for ``trainer.algorithm: crossq``.

    Args:
        hidden_sizes: hidden widths of the actor.
        critic_hidden_sizes: hidden widths of every critic (the paper's: 2048, 2048).
        obs_keys: observation entries to concatenate, in order (``None``: all, sorted by name).
        num_critics: critics in the ensemble (the paper's: 2).
        bn_momentum: the running statistics' rate (PyTorch's convention: 0.01 keeps 99%).
        actor_lr, critic_lr, alpha_lr: Adam learning rates (the paper's: 1e-3).
        betas: Adam's betas of the actor and the critics (the paper's: 0.5, 0.999); the
            temperature's are Adam's defaults.
        seed: seeds the initialisation.
    """

    target_critics = False

    def __init__(
        self,
        hidden_sizes: tuple[int, ...] = (256, 256),
        critic_hidden_sizes: tuple[int, ...] = (2048, 2048),
        obs_keys: list[str] | None = None,
        num_critics: int = 2,
        bn_momentum: float = 0.01,
        actor_lr: float = 1e-3,
        critic_lr: float = 1e-3,
        alpha_lr: float = 1e-3,
        betas: tuple[float, float] = (0.5, 0.999),
        seed: int = 0,
    ) -> None:
        super().__init__(hidden_sizes, obs_keys, num_critics, False, actor_lr, critic_lr, alpha_lr, seed)
        self.critic_hidden_sizes, self.bn_momentum = tuple(critic_hidden_sizes), bn_momentum
        self.betas = (float(betas[0]), float(betas[1]))

    def validate_config(self) -> list[tuple[str, str]]:
        problems = super().validate_config()
        if not self.critic_hidden_sizes or min(self.critic_hidden_sizes) < 1:
            why = f"must be positive widths, got {list(self.critic_hidden_sizes)}"
            problems.append(("critic_hidden_sizes", why))
        if not 0 < self.bn_momentum <= 1:
            problems.append(("bn_momentum", f"must be in (0, 1], got {self.bn_momentum}"))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(("betas", f"must be two numbers in [0, 1), got {list(self.betas)}"))
        return problems

    def make_critics(self, n_in: int) -> nn.Module:
        """Batch norm on the input, then ``Linear -> ReLU -> BatchNorm`` per hidden layer (SBX's
        order), then a linear output."""
        e, momentum = self.num_critics, self.bn_momentum
        layers: list[nn.Module] = [EnsembleBatchNorm(e, n_in, momentum)]
        for h in self.critic_hidden_sizes:
            layers += [EnsembleLinear(e, n_in, h), nn.ReLU(), EnsembleBatchNorm(e, h, momentum)]
            n_in = h
        return nn.Sequential(*layers, EnsembleLinear(e, n_in, 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        m = self.model
        return torch.optim.Adam(
            [
                {"params": list(m.actor.parameters()), "lr": self.actor_lr, "betas": self.betas},
                {"params": list(m.critics.parameters()), "lr": self.critic_lr, "betas": self.betas},
                {"params": [m.log_alpha], "lr": self.alpha_lr},
            ]
        )

    def q(
        self, x: torch.Tensor, action: torch.Tensor, net: str = "critics", frozen: bool = False
    ) -> torch.Tensor:
        """``[E, B]`` values of ``(x, action)``: with the batch's statistics (and a step of the
        running ones) unless ``frozen``, then through detached weights and the running statistics."""
        if net != "critics":
            raise ValueError(f"CrossQPolicy has no {net!r} critics: CrossQ learns without targets")
        self.model.critics.train(not frozen)
        return super().q(x, action, net, frozen)
