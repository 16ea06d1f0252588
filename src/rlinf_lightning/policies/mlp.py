"""MLPActorCritic: a policy and a value function on state observations (CleanRL's PPO nets).

Two MLPs (tanh, orthogonal initialisation; the policy's last layer at gain 0.01, the value's at
1) over the concatenated observation entries. The policy's head follows the env's action space:
continuous actions get a Gaussian with a state-independent log standard deviation
(``ppo_continuous_action.py``), discrete ones a categorical per action entry (``ppo.py``; a
``MultiDiscrete`` space's entries are independent, their logits padded to the widest entry). Built
from sizes (``obs_dim``, ``action_dim``, ``action_choices``, which an embodied task fills in from
its env before the policy is sent to the workers) with a seeded initialisation, so every replica
starts from the same weights; or loaded from a directory written by :meth:`save_pretrained`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import nn

from rlinf_lightning.policies.module import RLModule, anneal_problems, annealed, count_without_loading


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(n_in: int, hidden: tuple[int, ...], n_out: int, last_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [_layer(n_in, h, math.sqrt(2)), nn.Tanh()]
        n_in = h
    return nn.Sequential(*layers, _layer(n_in, n_out, last_gain))


class ActorCriticNet(nn.Module):
    """The actor's output is ``action_dim`` means (with ``log_std``) or, given ``action_choices``,
    ``action_dim x max(choices)`` logits."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden_sizes: tuple[int, ...],
        init_log_std: float,
        action_choices: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        width = action_dim if action_choices is None else action_dim * max(action_choices)
        self.actor = _mlp(obs_dim, hidden_sizes, width, 0.01)
        self.critic = _mlp(obs_dim, hidden_sizes, 1, 1.0)
        if action_choices is None:
            self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))


def _noise(
    draw: Callable[..., torch.Tensor], shape: torch.Size, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """``draw(shape)`` (``torch.randn``, ``torch.rand``); row ``i`` from ``generators[i]`` when given."""
    if generators is None:
        return draw(shape)
    return torch.stack([draw(shape[1:], generator=g) for g in generators])


class MLPActorCritic(RLModule):
    """An actor-critic MLP for state observations, Gaussian or categorical by the env's actions.

    Args:
        model_path: a directory written by :meth:`save_pretrained` (sizes and weights); ``None``
            builds a new network from ``hidden_sizes`` and the env's sizes.
        hidden_sizes: hidden layer widths of both MLPs.
        obs_keys: the observation entries to concatenate, in order (``None``: all, sorted by name).
        init_log_std: initial log standard deviation of continuous actions.
        lr: Adam learning rate.
        anneal_lr_steps: decay the learning rate linearly to 0 over this many optimizer steps
            (CleanRL's ``anneal_lr``: iterations x update epochs x minibatches); ``None`` keeps it.
        max_grad_norm: clip the global gradient norm to this before each step (0 disables).
        seed: seeds the initialisation of a new network (the same on every replica).
    """

    def __init__(
        self,
        model_path: str | None = None,
        hidden_sizes: tuple[int, ...] = (64, 64),
        obs_keys: list[str] | None = None,
        init_log_std: float = 0.0,
        lr: float = 3e-4,
        anneal_lr_steps: int | None = None,
        max_grad_norm: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.hidden_sizes = tuple(hidden_sizes)
        self.obs_keys = list(obs_keys) if obs_keys is not None else None
        self.init_log_std = init_log_std
        self.lr = lr
        self.anneal_lr_steps = anneal_lr_steps
        self.max_grad_norm = max_grad_norm
        self.seed = seed
        self.obs_dim: int | None = None
        self.action_dim: int | None = None  # action entries per policy call
        self.action_choices: tuple[int, ...] | None = None  # per entry, for discrete actions
        self.model: ActorCriticNet | None = None

    def validate_config(self) -> list[tuple[str, str]]:
        """(key, problem) pairs found without loading anything; empty when the config is fine."""
        problems = []
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            problems.append(
                ("model_path", f"{self.model_path!r} holds no config.json; save one with save_pretrained()")
            )
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        problems += anneal_problems(self.anneal_lr_steps)
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            problems.append(("hidden_sizes", f"must be positive widths, got {list(self.hidden_sizes)}"))
        return problems

    def _load_config(self) -> None:
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self.hidden_sizes = tuple(config["hidden_sizes"])
        self.obs_keys = config["obs_keys"]
        self.obs_dim, self.action_dim = config["obs_dim"], config["action_dim"]
        choices = config.get("action_choices")
        self.action_choices = tuple(choices) if choices is not None else None

    def configure_spaces(
        self, obs: TensorDict, action_shape: tuple[int, ...], action_choices: tuple[int, ...] | None = None
    ) -> None:
        """Take the network's sizes from an example observation batch and the env's action shape,
        and its head from ``action_choices`` (``None``: continuous actions; else the choices of
        each action entry, see ``EnvBatch``); for a saved network, check that they match."""
        if self.model_path is not None:
            self._load_config()
        if self.obs_keys is None:
            self.obs_keys = sorted(k for k, v in obs.items() if isinstance(v, torch.Tensor))
        obs_dim = int(self.features(obs).shape[-1])
        action_dim = int(math.prod(action_shape))
        choices = tuple(int(c) for c in action_choices) if action_choices is not None else None
        if choices is not None and len(choices) != action_dim:
            raise ValueError(f"{len(choices)} action choices for {action_dim} action entries")
        if self.model_path is not None and (obs_dim, action_dim, choices) != (
            self.obs_dim, self.action_dim, self.action_choices
        ):  # fmt: skip
            raise ValueError(
                f"{self.model_path}: the network takes {self.obs_dim} observation and {self.action_dim} "
                f"action dimensions (choices {self.action_choices}), the env has {obs_dim} and "
                f"{action_dim} (choices {choices})"
            )
        self.obs_dim, self.action_dim, self.action_choices = obs_dim, action_dim, choices

    def features(self, obs: TensorDict) -> torch.Tensor:
        keys = self.obs_keys if self.obs_keys is not None else sorted(obs.keys())
        lead = obs.batch_dims
        return torch.cat([obs[k].float().reshape(*obs.batch_size, -1) for k in keys], dim=lead)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.model_path is not None and self.obs_dim is None:
            self._load_config()
        if self.obs_dim is None or self.action_dim is None:
            raise ValueError("MLPActorCritic needs its sizes: call configure_spaces(obs, action_shape) first")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = ActorCriticNet(
                self.obs_dim, self.action_dim, self.hidden_sizes, self.init_log_std, self.action_choices
            )
        if self.model_path is not None:
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(str(Path(self.model_path) / "model.safetensors")))

    def parameter_count(self) -> int | None:
        """Counted on the meta device from the sizes; a saved model's config.json is read, its
        weights are not (the generic count would load them)."""
        return count_without_loading(self)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        assert self.model is not None, "configure_model() first"
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr, eps=1e-5)
        return annealed(optimizer, self.anneal_lr_steps)

    def _dist(self, obs: TensorDict) -> tuple[torch.distributions.Distribution, torch.Tensor]:
        """The action distribution over ``[B, action_dim]`` entries (independent; ``log_prob``
        and ``entropy`` per entry) and the features it came from."""
        x = self.features(obs)
        out = self.model.actor(x).float()  # float32 log-probs under bf16 autocast too
        if self.action_choices is None:
            return torch.distributions.Normal(out, self.model.log_std.exp().expand_as(out)), x
        choices = torch.tensor(self.action_choices, device=out.device)
        logits = out.reshape(*out.shape[:-1], len(self.action_choices), -1)
        padding = torch.arange(logits.shape[-1], device=out.device) >= choices[:, None]
        return torch.distributions.Categorical(logits=logits.masked_fill(padding, float("-inf"))), x

    def act(
        self, obs: TensorDict, deterministic: bool = False, generators: list[torch.Generator] | None = None
    ) -> TensorDict:
        """Actions (sampled, or the most likely), their log-probs and the values of ``obs``. Row
        ``i``'s noise comes from ``generators[i]`` when given, so a row's action does not depend on
        which other rows share its batch."""
        dist, x = self._dist(obs)
        if isinstance(dist, torch.distributions.Categorical):  # Gumbel-max: a sample of the logits
            logits = dist.logits
            if deterministic:
                action = logits.argmax(-1)
            else:
                u = _noise(torch.rand, logits.shape, generators).clamp_min(torch.finfo(torch.float32).tiny)
                action = (logits - torch.log(-torch.log(u)).to(logits.device, logits.dtype)).argmax(-1)
        elif deterministic:
            action = dist.mean
        else:
            noise = _noise(torch.randn, dist.mean.shape, generators)
            action = dist.mean + dist.stddev * noise.to(dist.mean.device, dist.mean.dtype)
        return TensorDict(
            {
                "action": action,
                "logprob": dist.log_prob(action).sum(-1),
                "value": self.model.critic(x).squeeze(-1),
            },
            batch_size=obs.batch_size,
        )

    def value(self, obs: TensorDict) -> torch.Tensor:
        return self.model.critic(self.features(obs)).squeeze(-1)

    def evaluate(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log-prob of batch["action"], entropy, value)`` under the current parameters."""
        dist, x = self._dist(batch["obs"])
        action = batch["action"].reshape(dist.batch_shape)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.model.critic(x).squeeze(-1)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` (sizes, observation keys) and ``model.safetensors`` to ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {"hidden_sizes": list(self.hidden_sizes), "obs_keys": self.obs_keys, "obs_dim": self.obs_dim,
                  "action_dim": self.action_dim, "action_choices": self.action_choices}  # fmt: skip
        (path / "config.json").write_text(json.dumps(config, indent=1))
        save_file(
            {k: v.contiguous() for k, v in self.model.state_dict().items()}, str(path / "model.safetensors")
        )
        return path
