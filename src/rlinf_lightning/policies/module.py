"""RLModule: the LightningModule-shaped base class users subclass to bring their own policy."""

from __future__ import annotations

from abc import abstractmethod

import torch
from tensordict import TensorDict


class RLModule(torch.nn.Module):
    """A policy the trainer can roll out and train.

    Like a ``LightningModule``: construct it cheaply with hyper-parameters only (it is pickled to
    the workers that need it), build the network in :meth:`configure_model` (called on the worker),
    and return the optimizer from :meth:`configure_optimizers`. Everything that trains lives in
    ``self.model`` (the train engines step it and sync its parameters to the rollout).

    A language-model policy implements :meth:`forward_logprobs`; an embodied actor-critic
    implements ``act(obs, deterministic, generator) -> TensorDict(action, logprob, value)``,
    ``value(obs)`` and ``evaluate(batch) -> (logprob, entropy, value)`` (see ``MLPActorCritic``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._logged: dict[str, tuple[float, int]] = {}

    @abstractmethod
    def configure_model(self) -> None:
        """Build or load the network on the hosting worker."""

    @abstractmethod
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Return the optimizer for the parameters this module trains."""

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs ``[B, T]`` of the batch's response tokens under the current parameters."""
        raise NotImplementedError(f"{type(self).__name__} is not a language-model policy")

    def train_flops(self, batch: TensorDict) -> float | None:
        """Model FLOPs of one forward and backward over ``batch`` (for ``perf/mfu``); ``None``
        when the policy does not say."""
        return None

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Record a scalar; the trainer sends it to the loggers with the iteration's metrics as
        ``actor/<name>``. Logged several times in an iteration (once per micro-batch), the mean is
        reported, as Lightning's ``self.log(..., on_epoch=True)`` does."""
        value = float(value.detach() if isinstance(value, torch.Tensor) else value)
        total, calls = self._logged.get(name, (0.0, 0))
        self._logged[name] = (total + value, calls + 1)

    def pop_logged(self) -> dict[str, float]:
        out = {name: total / calls for name, (total, calls) in self._logged.items()}
        self._logged = {}
        return out
