"""Train engines: how the actor's policy trains (``single`` here; ``ddp``/``fsdp`` register alike).

The actor stage hands an engine micro-batches of ``(loss_sum, count)``; the engine accumulates
gradients of the sums and, once per global batch, divides by the total count, clips and steps.
Dividing once at the end makes the update independent of how the batch was split.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.registry import Registry


class TrainEngine:
    """Interface: ``setup`` -> (``accumulate`` ...) -> ``step`` per global batch."""

    def setup(self, policy: RLModule, device: str) -> None:
        raise NotImplementedError

    def accumulate(self, batch: TensorDict, loss_fn: Callable[[RLModule, TensorDict], tuple]) -> dict:
        """Backward of ``loss_fn(policy, batch) -> (loss_sum, count, metrics)``, gradients summed.

        Returns ``{"loss_sum", "count", **metrics}`` as floats (summed over ranks when distributed).
        ``loss_fn`` is picklable, so distributed engines can run it on every rank's shard.
        """
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop anything ``setup`` started (rank processes); safe to call twice."""

    def onload(self) -> None:
        """Bring weights and optimizer state back onto the device (collocated context switch)."""

    def offload(self) -> None:
        """Move weights and optimizer state off the device while other stages run."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights, one tensor at a time, for syncing the rollout engine."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


TRAIN_ENGINES: Registry[type[TrainEngine]] = Registry("train strategy")


def build_train_engine(name: str, ranks: int, options: dict[str, Any]) -> TrainEngine:
    """The registered engine ``name`` with ``options``; data-parallel engines (those taking
    ``ranks``) also get ``ranks``. Building starts nothing: processes start in ``setup``."""
    cls = TRAIN_ENGINES.get(name)
    takes_ranks = "ranks" in inspect.signature(cls).parameters
    return cls(**options, **({"ranks": ranks} if takes_ranks else {}))


@TRAIN_ENGINES.register("single")
class SingleTrainEngine(TrainEngine):
    """One process, one replica of the model."""

    def setup(self, policy: RLModule, device: str) -> None:
        self.policy = policy
        policy.configure_model()
        policy.to(device)
        policy.train()
        self.optimizer = policy.configure_optimizers()
        self.optimizer.zero_grad(set_to_none=True)
        self._count = 0.0
        self._offloader = Offloader(device)

    def onload(self) -> None:
        self._offloader.onload(self.policy, self.optimizer)

    def offload(self) -> None:
        self._offloader.offload(self.policy, self.optimizer)

    def accumulate(self, batch, loss_fn):
        loss_sum, count, metrics = loss_fn(self.policy, batch)
        loss_sum.backward()
        self._count += float(count)
        return {
            "loss_sum": float(loss_sum.detach()),
            "count": float(count),
            **{k: float(v) for k, v in metrics.items()},
        }

    def step(self) -> dict[str, float]:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if self._count > 0:
            for p in params:
                p.grad.div_(self._count)
        max_norm = getattr(self.policy, "max_grad_norm", 0.0) or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._count = 0.0
        return {"grad_norm": float(grad_norm)}

    def named_weights(self):
        for name, p in self.policy.model.named_parameters():
            yield name, p.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.policy.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
