"""SACPolicy: a tanh-squashed Gaussian actor and an ensemble of Q critics on state observations,
the networks of SAC and RLPD (``algorithms.sac``).

The actor is an MLP (ReLU) giving each action entry a mean and a log standard deviation (squashed
into ``[LOG_STD_MIN, LOG_STD_MAX]``, CleanRL's); an action is ``tanh(mean + std * noise)``, in
``[-1, 1]`` (the env stage clips to the env's bounds). The critics are ``num_critics`` MLPs over
``(features, action)`` computed as one batched ensemble (a matrix per member), optionally with a
LayerNorm after every hidden layer (RLPD's; without learned scale and shift). The target critics
are a copy that only Polyak averaging moves (:func:`polyak`). Every draw comes as
a ``noise`` argument or from per-row generators, so updates and rollouts are the same under every
plan. Continuous actions only: a discrete action space is refused when the task shows it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict
from torch import nn

from rlinf_lightning.policies.mlp import _noise
from rlinf_lightning.policies.module import RLModule

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@torch.no_grad()
def polyak(target: torch.nn.Module, online: torch.nn.Module, tau: float) -> None:
    """``target <- tau online + (1 - tau) target``, parameter by parameter (and buffers copied)."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.lerp_(o, tau)
    for t, o in zip(target.buffers(), online.buffers(), strict=True):
        t.copy_(o)


class EnsembleLinear(nn.Module):
    """``members`` independent linear layers applied to ``[members, B, n_in]`` in one batched
    matmul; each member initialised as ``nn.Linear`` would be."""

    def __init__(self, members: int, n_in: int, n_out: int) -> None:
        super().__init__()
        layers = [nn.Linear(n_in, n_out) for _ in range(members)]
        self.weight = nn.Parameter(torch.stack([layer.weight.T for layer in layers]))
        self.bias = nn.Parameter(torch.stack([layer.bias[None] for layer in layers]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


def _critics(members: int, n_in: int, hidden: tuple[int, ...], layer_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers.append(EnsembleLinear(members, n_in, h))
        if layer_norm:
            layers.append(nn.LayerNorm(h, elementwise_affine=False))
        layers.append(nn.ReLU())
        n_in = h
    return nn.Sequential(*layers, EnsembleLinear(members, n_in, 1))


class SACNet(nn.Module):
    """Actor, critics (built by ``critics(n_in)`` after the actor, so a seed gives the same actor
    whatever the critics), their targets where ``target`` and the log temperature."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden_sizes: tuple[int, ...],
        critics: Callable[[int], nn.Module],
        target: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        n_in = obs_dim
        for h in hidden_sizes:
            layers += [nn.Linear(n_in, h), nn.ReLU()]
            n_in = h
        self.actor = nn.Sequential(*layers, nn.Linear(n_in, 2 * action_dim))
        self.critics = critics(obs_dim + action_dim)
        self.target = copy.deepcopy(self.critics).requires_grad_(False) if target else None
        self.log_alpha = nn.Parameter(torch.tensor(0.0))  # the learner sets the algorithm's init_alpha


@runtime_checkable
class SoftActorCritic(Protocol):
    """What the off-policy learner (``workflows/offpolicy``) calls on a policy: features of an
    observation, a squashed-Gaussian sample, the critics' values and their Polyak targets.
    :class:`SACPolicy` is one; the workflow checks a policy against it once, when it is built."""

    num_critics: int
    #: whether it keeps Polyak target critics (SAC, RLPD) or none (CrossQ)
    target_critics: bool

    def features(self, obs: TensorDict) -> torch.Tensor: ...

    def sample(self, x: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def q(
        self, x: torch.Tensor, action: torch.Tensor, net: str = "critics", frozen: bool = False
    ) -> torch.Tensor: ...

    def update_targets(self, tau: float) -> None: ...


class SACPolicy(RLModule):
    """A squashed-Gaussian actor with ``num_critics`` Q critics, for continuous actions.

    Args:
        hidden_sizes: hidden widths of the actor and of every critic.
        obs_keys: observation entries to concatenate, in order (``None``: all, sorted by name).
        num_critics: critics in the ensemble (SAC: 2; RLPD: 10).
        layer_norm: a LayerNorm after each critic hidden layer (RLPD).
        actor_lr: Adam learning rate of the actor.
        critic_lr: Adam learning rate of the critics.
        alpha_lr: Adam learning rate of the log temperature (its start is the algorithm's
            ``init_alpha``).
        seed: seeds the initialisation (the same on every replica).
    """

    max_grad_norm = 0.0  # no clipping: the three losses share one step (see algorithms.sac)
    #: whether the critics have Polyak-averaged targets (``update_targets``); CrossQ's have none
    target_critics = True

    def __init__(
        self,
        hidden_sizes: tuple[int, ...] = (256, 256),
        obs_keys: list[str] | None = None,
        num_critics: int = 2,
        layer_norm: bool = False,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        alpha_lr: float = 3e-4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.hidden_sizes, self.obs_keys = tuple(hidden_sizes), list(obs_keys) if obs_keys else None
        self.num_critics, self.layer_norm = num_critics, layer_norm
        self.actor_lr, self.critic_lr, self.alpha_lr = actor_lr, critic_lr, alpha_lr
        self.seed = seed
        self.obs_dim: int | None = None
        self.action_dim: int | None = None
        self.model: SACNet | None = None

    def validate_config(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("actor_lr", "critic_lr", "alpha_lr"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        if self.num_critics < 1:
            problems.append(("num_critics", f"must be >= 1, got {self.num_critics}"))
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            problems.append(("hidden_sizes", f"must be positive widths, got {list(self.hidden_sizes)}"))
        return problems

    def configure_spaces(
        self, obs: TensorDict, action_shape: tuple[int, ...], action_choices: tuple[int, ...] | None = None
    ) -> None:
        """Sizes from an example observation and the action shape; discrete actions are refused."""
        if action_choices is not None:
            raise ValueError("SAC needs continuous actions (a squashed Gaussian), the env's are discrete")
        if self.obs_keys is None:
            self.obs_keys = sorted(k for k, v in obs.items() if isinstance(v, torch.Tensor))
        self.obs_dim = int(self.features(obs).shape[-1])
        self.action_dim = int(math.prod(action_shape))

    def features(self, obs: TensorDict) -> torch.Tensor:
        keys = self.obs_keys if self.obs_keys is not None else sorted(obs.keys())
        return torch.cat([obs[k].float().reshape(*obs.batch_size, -1) for k in keys], dim=obs.batch_dims)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.obs_dim is None or self.action_dim is None:
            raise ValueError("SACPolicy needs its sizes: call configure_spaces(obs, action_shape) first")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = SACNet(
                self.obs_dim, self.action_dim, self.hidden_sizes, self.make_critics, self.target_critics
            )

    def make_critics(self, n_in: int) -> nn.Module:
        """The critic ensemble over ``n_in`` inputs (features and action): ``[E, B, n_in] -> [E, B, 1]``."""
        return _critics(self.num_critics, n_in, self.hidden_sizes, self.layer_norm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        m = self.model
        return torch.optim.Adam(
            [
                {"params": list(m.actor.parameters()), "lr": self.actor_lr},
                {"params": list(m.critics.parameters()), "lr": self.critic_lr},
                {"params": [m.log_alpha], "lr": self.alpha_lr},
            ]
        )

    # -- the actor -------------------------------------------------------------------------------
    def sample(self, x: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tanh(mean + std * noise), its log-prob)`` from features ``x``; ``noise`` ``None``: the
        deterministic action ``tanh(mean)`` (its log-prob at zero noise)."""
        mean, log_std = self.model.actor(x).float().chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        eps = torch.zeros_like(mean) if noise is None else noise.to(mean)
        u = mean + log_std.exp() * eps
        # log N(u; mean, std) - sum log(1 - tanh(u)^2), the latter as 2 (log 2 - u - softplus(-2u))
        gauss = -0.5 * eps**2 - log_std - 0.5 * math.log(2 * math.pi)
        squash = 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u))
        return torch.tanh(u), (gauss - squash).sum(-1)

    def act(
        self, obs: TensorDict, deterministic: bool = False, generators: list[torch.Generator] | None = None
    ) -> TensorDict:
        """Actions and their log-probs; row ``i``'s noise from ``generators[i]``. ``value`` is zero:
        an off-policy learner values transitions with its critics when it samples them."""
        x = self.features(obs)
        noise = (
            None if deterministic else _noise(torch.randn, torch.Size((len(x), self.action_dim)), generators)
        )
        action, logprob = self.sample(x, noise)
        return TensorDict(
            {"action": action, "logprob": logprob, "value": torch.zeros(len(x), device=x.device)},
            batch_size=obs.batch_size,
        )

    def value(self, obs: TensorDict) -> torch.Tensor:
        """Zero (see :meth:`act`): the env stage's bootstrap values are not used off-policy."""
        return torch.zeros(obs.batch_size[0])

    # -- the critics -----------------------------------------------------------------------------
    def q(
        self, x: torch.Tensor, action: torch.Tensor, net: str = "critics", frozen: bool = False
    ) -> torch.Tensor:
        """``[E, B]`` values of ``(x, action)`` under the critics (``net="target"``: the targets);
        ``frozen``: through detached weights, so a loss on them moves only what fed ``action``."""
        module = getattr(self.model, net)
        inp = torch.cat([x, action.reshape(len(x), -1)], dim=-1).expand(self.num_critics, *x.shape[:-1], -1)
        if not frozen:
            return module(inp).squeeze(-1)
        weights = {name: p.detach() for name, p in module.named_parameters()}
        return torch.func.functional_call(module, weights, (inp,)).squeeze(-1)

    def update_targets(self, tau: float) -> None:
        polyak(self.model.target, self.model.critics, tau)
