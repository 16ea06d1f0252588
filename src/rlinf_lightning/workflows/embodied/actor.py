"""The embodied actor: PPO (or GRPO over episodes) over the trajectories, trained and checkpointed."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.workflows.specs import EmbodiedSpec, RunSpec
from rlinf_lightning.workflows.training import TrainStage


def _tokens(logprob: torch.Tensor) -> torch.Tensor:
    """A sample's log-prob as GRPO's ``[B, T]`` tokens: one, or one per entry where the policy's
    factorises (``[B, N]``: π0's per-entry log-probs)."""
    return logprob[:, None] if logprob.dim() == 1 else logprob.flatten(1)


class EpisodeGRPOLoss:
    """GRPO's clipped surrogate on the masked steps (no critic); picklable, for every rank."""

    in_keys = ("obs", "action", "logprob", "advantage", "mask", "sample_id", "policy_version")

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def __call__(self, policy: RLModule, mb: TensorDict):
        logprob, entropy, _ = policy.evaluate(mb)
        mask = mb["mask"].float()[:, None]
        proximal = mb.get("proximal_logprob", None)
        loss_sum, count, metrics = self.algorithm.loss(
            _tokens(logprob),
            _tokens(mb["logprob"]),
            mb["advantage"],
            mask.expand_as(_tokens(logprob)),
            proximal_logprobs=None if proximal is None else _tokens(proximal),
        )
        mean_entropy = (entropy.detach() * mask[:, 0]).sum() / mask.sum().clamp_min(1.0)
        return loss_sum, count, {**metrics, "entropy": mean_entropy}


class PPOLoss:
    """``(policy, minibatch) -> (loss_sum, count, metrics)``; picklable, for every rank.

    ``critic_only`` (PPO's ``critic_warmup`` iterations): the surrogate sees zero advantages and
    no entropy gradient, so only the value loss moves the weights (the value head, and π0 under it
    where the critic's input is not detached)."""

    in_keys = ("obs", "action", "logprob", "value", "advantage", "return", "sample_id", "policy_version")

    def __init__(self, algorithm: Any, critic_only: bool = False) -> None:
        self.algorithm, self.critic_only = algorithm, critic_only

    def __call__(self, policy: RLModule, mb: TensorDict):
        logprob, entropy, value = policy.evaluate(mb)
        advantage = mb["advantage"]
        if self.critic_only:
            advantage, entropy = torch.zeros_like(advantage), entropy.detach()
        # with a proximal policy the value clip, too, is around the critic the actor holds
        old_value = mb["proximal_value"] if "proximal_value" in mb.keys() else mb["value"]
        return self.algorithm.loss(
            logprob, mb["logprob"], advantage, value, old_value, mb["return"], entropy,
            proximal_logprobs=mb.get("proximal_logprob", None),
        )  # fmt: skip


def proximal_outputs(policy: RLModule, mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of ``mb``'s actions and the values under ``policy`` as it is (no gradient: the
    caller runs it through ``engine.forward_all``); module-level, so a distributed engine's ranks
    can run it."""
    logprob, _, value = policy.evaluate(mb)
    return logprob, value


class PPOActorStage(TrainStage):
    """Keeps the iteration's samples; at its end, ``update_epochs`` passes of ``num_minibatches``
    optimizer steps on ``loss`` (PPO's, or GRPO's over episodes), fewer passes when the
    algorithm's ``target_kl`` stops them. Minibatches are cut by a permutation of the *global*
    sample ids (seeded by iteration and epoch), and advantages normalised (and the explained
    variance and early-stop KL measured) over the whole batch, so replicas of a data-parallel group
    together take exactly the steps one replica would."""

    name = "actor"
    end_per_sample = True  # every pass runs at the end, on the samples this replica kept

    def __init__(
        self, policy: RLModule, run: RunSpec, spec: EmbodiedSpec, loss: PPOLoss | EpisodeGRPOLoss
    ) -> None:
        super().__init__(policy, run.train, run.max_staleness)
        algorithm = run.algorithm
        self.algorithm, self.loss, self.seed = algorithm, loss, run.seed
        self.total_samples, self.micro_batch_size = spec.num_envs * spec.steps, spec.train_micro_batch_size
        self.in_keys = loss.in_keys
        self.update_epochs, self.num_minibatches = algorithm.update_epochs, algorithm.num_minibatches
        self.norm_adv, self.target_kl = algorithm.norm_adv, algorithm.target_kl

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        minibatch = -(-self.total_samples // self.num_minibatches)
        if self.micro_batch_size and self.micro_batch_size < minibatch:
            return f"micro-batches of {self.micro_batch_size} samples", ("task.train_micro_batch_size",)
        keys = ("task.train_micro_batch_size", "trainer.algorithm.num_minibatches")
        return f"minibatches of {minibatch} samples in one forward/backward", keys

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.iteration, self.buffer, self.metrics = iteration, [], Metrics()

    def process(self, batch: TensorDict) -> None:
        self.check_staleness(self.iteration, batch["policy_version"], self.metrics)
        self.buffer.append(batch)
        return None

    def _moments(self, *columns: torch.Tensor) -> tuple[list[tuple[float, float]], float]:
        """Each column's mean and (population) variance over the whole batch, every replica's
        samples pooled, and the number of samples."""
        x = [c.double() for c in columns]
        sums = [c.sum() for c in x] + [(c**2).sum() for c in x] + [torch.tensor(float(len(x[0])))]
        totals = torch.stack(sums).to(torch.float64)
        self.ctx.all_reduce([totals])
        *moments, count = totals.tolist()
        k, n = len(x), max(count, 1.0)
        return [(moments[i] / n, moments[k + i] / n - (moments[i] / n) ** 2) for i in range(k)], count

    def _normalize(self, data: TensorDict | None) -> None:
        adv = data["advantage"] if data is not None else torch.zeros(0)
        [(mean, var)], count = self._moments(adv)
        std = max(var * count / max(count - 1, 1.0), 0.0) ** 0.5
        if data is not None:
            data["advantage"] = (adv - mean) / (std + 1e-8)

    def _explained_variance(self, data: TensorDict | None, metrics: Metrics) -> None:
        """CleanRL's ``1 - Var(returns - values) / Var(returns)`` of the rollout's values, over
        the whole batch: how much of the returns the critic predicts (1: all; <= 0: nothing)."""
        returns = data["return"] if data is not None else torch.zeros(0)
        error = returns.double() - data["value"].double() if data is not None else torch.zeros(0)
        [(_, var_returns), (_, var_error)], _ = self._moments(returns, error)
        if var_returns > 0:
            metrics.mean("explained_variance", 1.0 - var_error / var_returns)

    def _kl_exceeded(self, kl_sum: float, count: float) -> bool:
        """Whether the approximate KL of a pass's last minibatch (summed over the replicas) is
        above ``target_kl``: every replica decides alike."""
        totals = torch.tensor([kl_sum, count], dtype=torch.float64)
        self.ctx.all_reduce([totals])
        return bool(totals[1] > 0) and float(totals[0] / totals[1]) > self.target_kl

    def end_iteration(self) -> Metrics:
        data = torch.cat(self.buffer) if self.buffer else None
        metrics = self.metrics
        if "return" in self.loss.in_keys:
            self._explained_variance(data, metrics)
        if self.norm_adv:
            self._normalize(data)
        if "proximal_logprobs" in self.algorithm.reads:  # the actor before its steps (every rank calls)
            chunks = []
            if data is not None:  # a minibatch per forward, or a micro-batch where that is smaller
                size = max(1, -(-len(data) // self.num_minibatches))
                chunks = list(data.split(min(size, self.micro_batch_size or size)))
            proximal = self.engine.forward_all(chunks, proximal_outputs)
            if data is not None:
                data["proximal_logprob"] = torch.cat([lp.cpu() for lp, _ in proximal])
                data["proximal_value"] = torch.cat([v.cpu() for _, v in proximal])
        loss = self.loss
        if self.iteration <= self.algorithm.critic_warmup:
            loss = PPOLoss(self.algorithm, critic_only=True)
            metrics.mean("warmup", 1.0)
        epochs = 0
        for epoch in range(self.update_epochs):
            g = torch.Generator().manual_seed(row_seed(self.seed, self.iteration, epoch))
            position = torch.empty(self.total_samples, dtype=torch.long)
            position[torch.randperm(self.total_samples, generator=g)] = torch.arange(self.total_samples)
            minibatch = (
                position[data["sample_id"]] * self.num_minibatches // self.total_samples
                if data is not None
                else None
            )
            for m in range(self.num_minibatches):
                kl_sum, count = 0.0, 0.0
                if data is not None and bool((minibatch == m).any()):
                    mb = data[minibatch == m]
                    for piece in mb.split(self.micro_batch_size or len(mb)):  # gradient accumulation
                        stats = self.engine.accumulate(piece, loss)
                        for k, v in stats.items():
                            metrics.mean(k, v, len(piece))
                        kl_sum += stats.get("approx_kl", 0.0) * len(piece)
                        count += float(len(piece))
                self.step(metrics)
            epochs += 1
            if self.target_kl is not None and self._kl_exceeded(kl_sum, count):
                break
        metrics.mean("epochs", epochs)
        return metrics
