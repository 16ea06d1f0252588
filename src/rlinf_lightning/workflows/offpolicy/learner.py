"""The off-policy learner: writes the env stage's transitions into its replay buffer and, at the
end of each iteration, takes ``updates_per_step`` updates per new transition (SAC's, RLPD's
or CrossQ's, ``algorithms.sac``) on batches sampled from it (and from the demonstrations)."""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.sac import (
    SAC,
    CrossQ,
    actor_loss,
    critic_loss,
    critic_target,
    temperature_loss,
)
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.flow.memory import count_text
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.workflows.offpolicy.replay import TRANSITION_KEYS, ReplayBuffer
from rlinf_lightning.workflows.training import TrainStage


class SACLoss:
    """``(policy, batch) -> (loss_sum, count, metrics)``: the sum of SAC's critic, actor and
    temperature losses on a batch that carries its own draws (``noise``: ``[B, 2, |A|]``, the
    next action's and the actor's; ``critic_subset``: ``[B, K]``, the critics of the target) and
    whether the actor learns at this update (``update_actor``: ``[B]``, all alike; the policy
    delay): without it the sum is the critics' loss alone."""

    def __init__(self, algorithm: SAC, target_entropy: float) -> None:
        self.gamma, self.aggregate = algorithm.gamma, algorithm.actor_aggregate
        self.bootstrap_at_termination = algorithm.bootstrap_at_termination
        self.target_entropy = target_entropy

    def critic_values(self, policy: RLModule, x: torch.Tensor, next_x: torch.Tensor, mb: TensorDict):
        """``Q_i(s, a)`` ``[E, B]``, the values the target reads at ``(s', a')`` ``[E, B]`` (here
        the target critics') and ``log pi(a'|s')`` ``[B]``."""
        with torch.no_grad():
            next_action, next_logprob = policy.sample(next_x, mb["noise"][:, 0])
            next_q = policy.q(next_x, next_action, net="target")
        return policy.q(x, mb["action"]), next_q, next_logprob

    def __call__(self, policy: RLModule, mb: TensorDict):
        log_alpha = policy.model.log_alpha
        alpha = log_alpha.exp().detach()
        x, next_x = policy.features(mb["obs"]), policy.features(mb["next_obs"])
        q, next_q, next_logprob = self.critic_values(policy, x, next_x, mb)
        with torch.no_grad():
            next_q = next_q.gather(0, mb["critic_subset"][0][:, None].expand(-1, len(x))).min(0).values
            ended = torch.zeros_like(mb["terminated"]) if self.bootstrap_at_termination else mb["terminated"]
            target = critic_target(mb["reward"], ended, next_q, next_logprob, alpha, self.gamma)
        total = q_loss = critic_loss(q, target)
        metrics = {"critic_loss": q_loss.detach(), "alpha": alpha, "q": q.detach().mean()}
        if bool(mb["update_actor"][0]):
            action, logprob = policy.sample(x, mb["noise"][:, 1])
            q_pi = policy.q(x, action, frozen=True)
            q_pi = q_pi.min(0).values if self.aggregate == "min" else q_pi.mean(0)
            pi_loss = actor_loss(logprob, q_pi, alpha)
            alpha_loss = temperature_loss(log_alpha, logprob, self.target_entropy)
            total = q_loss + pi_loss + alpha_loss
            metrics |= {"actor_loss": pi_loss.detach(), "alpha_loss": alpha_loss.detach(),
                        "entropy": -logprob.detach().mean()}  # fmt: skip
        return total * len(x), len(x), metrics


class CrossQLoss(SACLoss):
    """:class:`SACLoss` without targets: ``(s, a)`` and ``(s', a')`` through the (batch-normalized)
    critics as one batch, so its statistics cover both; the next values under a stop-gradient."""

    def critic_values(self, policy: RLModule, x: torch.Tensor, next_x: torch.Tensor, mb: TensorDict):
        with torch.no_grad():
            next_action, next_logprob = policy.sample(next_x, mb["noise"][:, 0])
        both = policy.q(torch.cat([x, next_x]), torch.cat([mb["action"], next_action]))
        q, next_q = both.split(len(x), dim=1)
        return q, next_q.detach(), next_logprob


class OffPolicyLearnerStage(TrainStage):
    """Keeps the iteration's trajectories; at its end writes them into the replay buffer in env
    order (the same buffer whatever order the shards arrived in), then updates.

    Args:
        policy: a :class:`~rlinf_lightning.policies.SACPolicy` (CrossQ: a ``CrossQPolicy``) or any
            module with its methods.
        algorithm: :class:`~rlinf_lightning.algorithms.SAC` or a subclass (RLPD, CrossQ).
        train: the train engine and precision.
        transition_bytes: bytes of one stored transition (for the memory check).
        demos: demonstration transitions (``[N]``), or ``None``.
        seed: seeds every update's draws (batch rows, noise, critic subset) with the update's index.
        max_staleness: how many versions behind the weights the trajectories may be.
    """

    name = "actor"
    end_per_sample = True
    in_keys = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "env_id", "policy_version")

    def __init__(
        self,
        policy: RLModule,
        algorithm: SAC,
        train: TrainSpec,
        transition_bytes: int,
        demos: TensorDict | None = None,
        seed: int = 0,
        max_staleness: int = 0,
    ) -> None:
        super().__init__(policy, train, max_staleness)
        self.algorithm, self.transition_bytes, self.demos, self.seed = (
            algorithm,
            transition_bytes,
            demos,
            seed,
        )
        action_dim = policy.action_dim or 0
        entropy = -float(action_dim) if algorithm.target_entropy is None else algorithm.target_entropy
        self.loss = (CrossQLoss if isinstance(algorithm, CrossQ) else SACLoss)(algorithm, entropy)
        self.subset = algorithm.critic_subset or policy.num_critics
        self.demo_rows = round(algorithm.batch_size * algorithm.demo_ratio) if demos is not None else 0

    def check_placement(self, replicas: int, own_process: bool) -> list[tuple[str, str]]:
        """On several replicas each takes a slice of every batch, gradients summed by the engine:
        not CrossQ (its batch statistics would be a slice's) nor a policy delay (the engine
        gives the actor a zero gradient between its updates, and Adam moves on zeros)."""
        problems = []
        if replicas > 1 and isinstance(self.algorithm, CrossQ):
            why = (f"CrossQ normalizes over the whole batch, the plan gives the learner {replicas} "
                   "replicas: use trainer.devices=1, or a placement with `actor` on one slot")  # fmt: skip
            problems.append(("trainer.strategy", why))
        elif replicas > 1 and self.algorithm.policy_delay > 1:
            why = f"a learner on {replicas} replicas updates the actor at every update: set it to 1"
            problems.append(("trainer.algorithm.policy_delay", why))
        return problems + super().check_placement(replicas, own_process)

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The train state (:meth:`TrainStage.memory`) and the replay buffer at its capacity (and
        the demonstrations)."""
        parts = super().memory(device, replicas, micro_batch)
        capacity = self.algorithm.buffer_capacity + (len(self.demos) if self.demos is not None else 0)
        what = f"replay buffer: {count_text(capacity)} transitions x {self.transition_bytes} bytes"
        buffer = MemoryPart(
            capacity * self.transition_bytes, what, "trainer.algorithm.init_args.buffer_capacity"
        )
        return None if parts is None else [*parts, buffer]

    def setup(self, ctx) -> None:
        super().setup(ctx)
        with torch.no_grad():  # the temperature starts where the algorithm says (a checkpoint overrides it)
            self.engine.policy.model.log_alpha.fill_(math.log(self.algorithm.init_alpha))
        self.buffer = ReplayBuffer(self.algorithm.buffer_capacity)
        self.owed = 0.0  # updates earned by the transitions so far, not yet taken (a fractional UTD)
        self.updates = 0  # updates taken in the whole run (the policy delay counts them)

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.trajectories: list[TensorDict] = []
        self.metrics = Metrics()

    def process(self, batch: TensorDict) -> None:
        self.check_staleness(self.iteration, batch["policy_version"].flatten(), self.metrics)
        self.trajectories.append(batch.select(*TRANSITION_KEYS, "env_id"))
        return None

    def _gathered(self) -> TensorDict:
        """This iteration's trajectories, every replica's: each replica of a data-parallel learner
        receives only its shards, and writes all of them into its own buffer, so that every
        replica's buffer, and every update's batch, is the one a single learner would have."""
        mine = torch.cat(self.trajectories) if self.trajectories else None
        if self.ctx.replicas == 1:
            return mine
        import torch.distributed as dist

        parts: list[TensorDict | None] = [None] * self.ctx.replicas
        dist.all_gather_object(parts, mine, group=self.ctx.process_group())
        return torch.cat([p for p in parts if p is not None])

    def _transitions(self) -> TensorDict:
        """This iteration's transitions, step by step, env by env within a step."""
        data = self._gathered()
        data = data[data["env_id"].argsort()]
        n, steps = data["reward"].shape
        return TensorDict(
            {k: data[k].transpose(0, 1).reshape(n * steps, *data[k].shape[2:]) for k in TRANSITION_KEYS},
            batch_size=[n * steps],
        )

    def _batch(self, update: int) -> TensorDict:
        """Update ``update``'s batch: online rows and demonstration rows, with its draws."""
        g = torch.Generator().manual_seed(row_seed(self.seed, self.iteration, update))
        batch = self.buffer.sample(self.algorithm.batch_size - self.demo_rows, g)
        if self.demo_rows:
            rows = torch.randint(len(self.demos), (self.demo_rows,), generator=g)
            batch = torch.cat([batch, self.demos[rows]])
        n = len(batch)
        batch["noise"] = torch.randn(n, 2, self.policy.action_dim, generator=g)
        subset = torch.randperm(self.policy.num_critics, generator=g)[: self.subset]
        batch["critic_subset"] = subset.expand(n, -1)
        batch["update_actor"] = torch.full((n,), self.updates % self.algorithm.policy_delay == 0)
        return batch[self.ctx.replica :: self.ctx.replicas]  # the engine sums the replicas' gradients

    def end_iteration(self) -> Metrics:
        metrics = self.metrics
        new = self._transitions()
        self.buffer.add(new)
        if len(self.buffer) >= self.algorithm.learning_starts:
            self.owed += self.algorithm.updates_per_step * len(new)
        updates, self.owed = int(self.owed), self.owed - int(self.owed)
        policy = self.engine.policy
        for u in range(updates):
            for k, v in self.engine.accumulate(self._batch(u), self.loss).items():
                metrics.mean(k, v)
            self.step(metrics)
            self.updates += 1
            if self.algorithm.target_critics:
                policy.update_targets(self.algorithm.tau)
        metrics.sum("updates", updates)
        metrics.mean("buffer_size", float(len(self.buffer)))
        return metrics

    def extra_state(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict(), "owed": self.owed, "updates": self.updates}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.owed, self.updates = state["owed"], state["updates"]
