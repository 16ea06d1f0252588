"""MLPActorCritic: a Gaussian policy and a value function on state observations (CleanRL's PPO net).

Two MLPs (tanh, orthogonal initialisation; the policy's last layer at gain 0.01, the value's at
1) over the concatenated observation entries, and a state-independent log standard deviation.
Built from sizes (``obs_dim``/``action_dim``, which an embodied task fills in from its env before
the policy is sent to the workers) with a seeded initialisation, so every replica starts from the
same weights; or loaded from a directory written by :meth:`save_pretrained`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import nn

from rlinf_lightning.policies.module import RLModule, count_without_loading


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
    def __init__(
        self, obs_dim: int, action_dim: int, hidden_sizes: tuple[int, ...], init_log_std: float
    ) -> None:
        super().__init__()
        self.actor = _mlp(obs_dim, hidden_sizes, action_dim, 0.01)
        self.critic = _mlp(obs_dim, hidden_sizes, 1, 1.0)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))


class MLPActorCritic(RLModule):
    """A Gaussian actor-critic MLP for state observations.

    Args:
        model_path: a directory written by :meth:`save_pretrained` (sizes and weights); ``None``
            builds a new network from ``hidden_sizes`` and the env's sizes.
        hidden_sizes: hidden layer widths of both MLPs.
        obs_keys: the observation entries to concatenate, in order (``None``: all, sorted by name).
        init_log_std: initial log standard deviation of the actions.
        lr: Adam learning rate.
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
        max_grad_norm: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.hidden_sizes = tuple(hidden_sizes)
        self.obs_keys = list(obs_keys) if obs_keys is not None else None
        self.init_log_std = init_log_std
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.seed = seed
        self.obs_dim: int | None = None
        self.action_dim: int | None = None
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
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            problems.append(("hidden_sizes", f"must be positive widths, got {list(self.hidden_sizes)}"))
        return problems

    def _load_config(self) -> None:
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self.hidden_sizes = tuple(config["hidden_sizes"])
        self.obs_keys = config["obs_keys"]
        self.obs_dim, self.action_dim = config["obs_dim"], config["action_dim"]

    def configure_spaces(self, obs: TensorDict, action_shape: tuple[int, ...]) -> None:
        """Take the network's sizes from an example observation batch and the env's action shape
        (for a saved network: check that they match)."""
        if self.model_path is not None:
            self._load_config()
        if self.obs_keys is None:
            self.obs_keys = sorted(k for k, v in obs.items() if isinstance(v, torch.Tensor))
        obs_dim = int(self.features(obs).shape[-1])
        action_dim = int(math.prod(action_shape))
        if self.model_path is not None and (obs_dim, action_dim) != (self.obs_dim, self.action_dim):
            raise ValueError(
                f"{self.model_path}: the network takes {self.obs_dim} observation and {self.action_dim} "
                f"action dimensions, the env has {obs_dim} and {action_dim}"
            )
        self.obs_dim, self.action_dim = obs_dim, action_dim

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
            self.model = ActorCriticNet(self.obs_dim, self.action_dim, self.hidden_sizes, self.init_log_std)
        if self.model_path is not None:
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(str(Path(self.model_path) / "model.safetensors")))

    def parameter_count(self) -> int | None:
        """Counted on the meta device from the sizes; a saved model's config.json is read, its
        weights are not (the generic count would load them)."""
        return count_without_loading(self)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() first"
        return torch.optim.Adam(self.model.parameters(), lr=self.lr, eps=1e-5)

    def _dist(self, obs: TensorDict) -> tuple[torch.distributions.Normal, torch.Tensor]:
        x = self.features(obs)
        mean = self.model.actor(x)
        return torch.distributions.Normal(mean, self.model.log_std.exp().expand_as(mean)), x

    def act(
        self, obs: TensorDict, deterministic: bool = False, generators: list[torch.Generator] | None = None
    ) -> TensorDict:
        """Actions (sampled, or the mean), their log-probs and the values of ``obs``. Row ``i``'s
        noise comes from ``generators[i]`` when given, so a row's action does not depend on which
        other rows share its batch."""
        dist, x = self._dist(obs)
        if deterministic:
            action = dist.mean
        else:
            shape = dist.mean.shape[1:]
            if generators is not None:
                noise = torch.stack([torch.randn(shape, generator=g) for g in generators])
            else:
                noise = torch.randn(dist.mean.shape)
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
        action = batch["action"].reshape(dist.mean.shape)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.model.critic(x).squeeze(-1)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` (sizes, observation keys) and ``model.safetensors`` to ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {"hidden_sizes": list(self.hidden_sizes), "obs_keys": self.obs_keys, "obs_dim": self.obs_dim,
                  "action_dim": self.action_dim}  # fmt: skip
        (path / "config.json").write_text(json.dumps(config, indent=1))
        save_file(
            {k: v.contiguous() for k, v in self.model.state_dict().items()}, str(path / "model.safetensors")
        )
        return path
