"""The actor stage: the policy loss over mini-batches and micro-batches, trained and checkpointed."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.losses import kl_penalty
from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, resolve_rollout_dtype
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.budget import Budget, LayerShape, StepCost, actor_cost
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, StageContext
from rlinf_lightning.flow.token_budget import TokenBudget
from rlinf_lightning.kernels.chunked_head import LogitMap
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.workflows.mini_batches import mini_batch_steps
from rlinf_lightning.workflows.padding import micro_batches
from rlinf_lightning.workflows.reasoning.advantage import adapted_kl_coef
from rlinf_lightning.workflows.specs import NO_BUDGET, BudgetSpec, RolloutSpec, RunSpec
from rlinf_lightning.workflows.training import TrainStage, policy_dtype

#: the truncated-importance-sampling cap a bf16 rollout chosen by ``rollout_dtype: auto`` turns on
#: (Yao et al., 2025, use 2)
AUTO_TIS_CAP = 2.0


class PolicyLoss:
    """``(policy, micro_batch) -> (loss_sum, count, metrics)``; picklable, so every rank of a
    distributed train engine can run it on its shard.

    The ratio's denominator is the behaviour policy's log-probs: ``old_logprobs`` when the actor
    took them before its first step (several updates per batch, or ``tis_cap``), else the
    rollout's. The proximal log-probs of an off-policy correction are the actor's before its
    first step: ``old_logprobs``, or, when it steps once, its log-probs now (it has not stepped
    yet). ``kl_coef`` is the KL coefficient of this iteration (adaptive ones change)."""

    def __init__(self, algorithm: Any, temperature: float, horizon: int | None = None) -> None:
        self.algorithm, self.temperature, self.horizon = algorithm, temperature, horizon
        self.kl_coef = algorithm.kl_coef

    def __call__(self, policy: LMPolicy, mb: TensorDict):
        entropy = None
        if self.algorithm.entropy_coef > 0:  # an entropy bonus: with its gradient
            logp, entropy = policy.forward_logprobs(mb, self.temperature, with_entropy=True)
        else:
            logp = policy.forward_logprobs(mb, self.temperature)
        if "old_logprobs" in mb.keys():
            old = mb["old_logprobs"]
        elif self.algorithm.tis_cap is not None:
            old = logp.detach()  # one step per batch: the actor's log-probs before it
        else:
            old = mb["rollout_logprobs"]
        return self.algorithm.loss(
            logp,
            old,
            mb["advantage"],
            mb[LOSS_MASK],
            mb.get("ref_logprobs", None),
            rollout_logprobs=mb["rollout_logprobs"],
            proximal_logprobs=mb["old_logprobs"] if "old_logprobs" in mb.keys() else logp.detach(),
            entropy=entropy,
            kl_coef=self.kl_coef,
            horizon=self.horizon,
        )


def behaviour_logprobs(policy: LMPolicy, mb: TensorDict, temperature: float) -> torch.Tensor:
    """The actor's log-probs of a micro-batch's responses, no gradient (before its first step)."""
    return policy.forward_logprobs(mb, temperature)


class ActorStage(TokenBudget, TrainStage):
    """Trains the policy on each rollout batch.

    One update per batch (``ppo_epochs = num_mini_batches = 1``, no whitening): the gradient is
    accumulated over micro-batches as they arrive and the optimizer steps once at the end of the
    iteration. Otherwise the batch is kept; at its end the advantages are whitened over all of it
    (``norm_adv``), the behaviour log-probs are taken before the first step, and ``ppo_epochs``
    passes of ``num_mini_batches`` optimizer steps run. A mini-batch is a set of whole prompt
    groups drawn by a permutation of the iteration's group positions seeded by iteration and
    epoch, and each step divides by its own mini-batch's count over every replica, so replicas of
    a data-parallel group take exactly the steps one replica would.

    Every replica of the group hosting it is a rank of its train engine (``train.engine``).

    With ``rollout_dtype`` ``auto`` and an algorithm whose ``tis_cap`` is unset (and that has no
    off-policy correction, which weights the same tokens), a rollout that resolves to a lower
    precision than the policy's weights (bf16 beside a float32 actor) turns on truncated
    importance sampling at :data:`AUTO_TIS_CAP`, correcting the log-prob mismatch the faster
    rollout brings; an explicit ``rollout_dtype`` leaves the algorithm as configured.

    ``run.algorithm`` is the one the workflow runs; ``rollout`` says what the samples are (their
    temperature, longest prompt and response, prompt groups per iteration, the rollout's dtype);
    ``budget`` cuts its forward/backward passes.

    With neither ``task.train_micro_batch_size`` nor ``task.train_max_tokens_per_micro_batch`` set,
    the plan's memory check chooses its token budget (:class:`TokenBudget`, ``flow.budget``:
    ``actor_cost``), with activation checkpointing where the budget without it would be small and
    ``policy.gradient_checkpointing`` is unset.
    """

    budget_key = "task.train_max_tokens_per_micro_batch"
    budget_fixes = (
        "use a smaller model, trainer.precision=bf16-true, policy.gradient_checkpointing=true or more devices"
    )
    working_what = "activations and logits"
    offers_checkpointing = True

    name = "actor"
    cost_hint = 1.0
    in_keys = (
        "input_ids",
        "attention_mask",
        LOSS_MASK,
        "rollout_logprobs",
        "advantage",
        "group_id",
        "policy_version",
    )

    def __init__(
        self, policy: LMPolicy, run: RunSpec, rollout: RolloutSpec, budget: BudgetSpec = NO_BUDGET
    ) -> None:
        super().__init__(policy, run.train, run.max_staleness)
        algorithm = run.algorithm
        self.algorithm, self.seed, self.temperature = algorithm, run.seed, rollout.temperature
        self.max_prompt_tokens, self.rollout_dtype = rollout.max_prompt_tokens, rollout.dtype
        self.horizon, self.prompts_per_iteration = rollout.horizon, rollout.prompts
        self.train_micro_batch_size, self.max_tokens = budget.micro_batch_size, budget.max_tokens
        self.updates = algorithm.updates_per_batch
        self.keeps_batch = self.updates > 1 or algorithm.norm_adv
        self.end_per_sample = self.keeps_batch  # then every pass runs at the end of the iteration
        self.adaptive_kl = (
            algorithm.needs_reference and not algorithm.kl_in_reward and algorithm.kl_target is not None
        )
        if algorithm.needs_reference:
            self.in_keys = (*self.in_keys, "ref_logprobs")

    def memory(
        self, device: str, replicas: int, micro_batch: int, budget: Budget | None = None
    ) -> list[MemoryPart] | None:
        """The train engine's state (``TrainStage.memory``) and, under a token budget (configured,
        or ``budget``: the plan's), what a step over a micro-batch of that many tokens adds at its
        peak: activations and logits (``flow.budget.actor_cost``)."""
        return self.with_working(device, self.budget_state(device, replicas, micro_batch), budget)

    def budget_configured(self) -> bool:
        return bool(self.train_micro_batch_size)

    def budget_state(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        return TrainStage.memory(self, device, replicas, micro_batch)

    def budget_cost(self, device: str, static: float, checkpointing: bool) -> StepCost | None:
        shape = LayerShape.from_dir(self.policy.model_path)
        if shape is None:
            return None
        residual, compute = self.step_dtype_bytes(device)
        prompt = self.max_prompt_tokens or 0
        # an FSDP2-sharded lm head takes the whole logits (``LMPolicy.forward_logprobs``)
        chunk = None if self.train_engine == "fsdp" else self.policy.logit_chunk_tokens
        return actor_cost(
            shape,
            static,
            residual=residual,
            compute=compute,
            checkpointing=checkpointing,
            logit_chunk=chunk,
            mapped_logits=not LogitMap.from_dir(self.policy.model_path).identity,
            response_fraction=self.horizon / (prompt + self.horizon),
        )

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        alg = self.algorithm
        corrected = alg.off_policy_correction != "none"  # weights the same tokens
        # only an algorithm with a tis_cap option of its own applies one (not the base's declared off)
        has_cap = dataclasses.is_dataclass(alg) and any(f.name == "tis_cap" for f in dataclasses.fields(alg))
        if self.rollout_dtype == AUTO_ROLLOUT_DTYPE and has_cap and alg.tis_cap is None and not corrected:
            policy = policy_dtype(self.policy)
            if resolve_rollout_dtype(self.rollout_dtype, self.precision, ctx.device, policy) != policy:
                self.algorithm = dataclasses.replace(self.algorithm, tis_cap=AUTO_TIS_CAP)
        self.loss = PolicyLoss(self.algorithm, self.temperature, self.horizon)
        self.metrics = Metrics()
        self.kl_seen = torch.zeros(2, dtype=torch.float64)  # KL x samples, samples (adaptive KL)

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        if self.max_tokens:
            return f"micro-batches of at most {self.max_tokens} tokens", (
                "task.train_max_tokens_per_micro_batch",
            )
        if self.train_micro_batch_size:
            return f"micro-batches of {self.train_micro_batch_size} samples", ("task.train_micro_batch_size",)
        return f"micro-batches of {micro_batch} samples (the plan's messages)", (
            "task.train_micro_batch_size",
            "trainer.micro_batch_size",
        )

    def engine_info(self) -> dict[str, Any]:
        """The train engine's, and the truncated-importance-sampling cap in force (``None``: off)."""
        return {**super().engine_info(), "tis_cap": self.algorithm.tis_cap}

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.iteration, self.buffer = iteration, []
        self.warming_up = iteration <= self.algorithm.critic_warmup

    def process(self, batch: TensorDict) -> None:
        self.check_staleness(self.iteration, batch["policy_version"], self.metrics)
        if self.warming_up:  # only the critic trains (PPO's critic_warmup)
            return None
        if self.adaptive_kl:  # KL(rollout policy || reference) per token, what the controller steers
            alg, mask = self.algorithm, batch[LOSS_MASK]
            kl = kl_penalty(batch["rollout_logprobs"], batch["ref_logprobs"], alg.kl_estimator) * mask
            self.kl_seen += torch.tensor([float(kl.sum()), float(mask.sum())], dtype=torch.float64)
        if self.keeps_batch:
            self.buffer.append(batch)
            return None
        self._train_on(batch, self.metrics)
        return None

    def _train_on(self, batch: TensorDict, metrics: Metrics) -> None:
        for chunk in micro_batches(batch, self.train_micro_batch_size, self.max_tokens):
            for k, v in self.engine.accumulate(chunk, self.loss).items():
                metrics.mean(k, v, len(chunk))

    def end_iteration(self) -> Metrics:
        metrics = self.metrics.take()
        if self.warming_up:
            metrics.mean("warmup", 1.0)
            return metrics
        if self.keeps_batch:
            self._update_on_kept_batch(metrics)
        else:
            self.step(metrics)
        self._adapt_kl(metrics)
        return metrics

    def extra_state(self) -> dict[str, Any]:
        """The adaptive KL coefficient (the engine's state is the train role's checkpoint)."""
        return {"kl_coef": self.loss.kl_coef} if self.adaptive_kl else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.loss.kl_coef = float(state["kl_coef"])

    def _adapt_kl(self, metrics: Metrics) -> None:
        if not self.adaptive_kl:
            return
        self.loss.kl_coef = adapted_kl_coef(self.ctx, self.algorithm, self.loss.kl_coef, self.kl_seen)
        metrics.mean("kl_coef", self.loss.kl_coef)
        self.kl_seen.zero_()

    def _whiten(self) -> None:
        """Advantages to zero mean and unit std over every response token of the rollout batch
        (the moments summed over the replicas)."""
        moments = torch.zeros(3, dtype=torch.float64)
        for b in self.buffer:
            adv, mask = b["advantage"].double(), b[LOSS_MASK].double()
            moments += torch.stack([(adv * mask).sum(), (adv**2 * mask).sum(), mask.sum()])
        self.ctx.all_reduce([moments])
        total, squares, count = moments.tolist()
        mean = total / max(count, 1.0)
        std = max((squares / max(count, 1.0) - mean**2) * count / max(count - 1.0, 1.0), 0.0) ** 0.5
        for b in self.buffer:
            b["advantage"] = ((b["advantage"] - mean) / (std + 1e-8)) * b[LOSS_MASK]

    def _update_on_kept_batch(self, metrics: Metrics) -> None:
        if self.algorithm.norm_adv:
            self._whiten()
        if self.updates > 1 or self.algorithm.tis_cap is not None:
            for b in self.buffer:  # the behaviour policy: the actor before its first step
                b["row"] = torch.arange(len(b))
                chunks = micro_batches(b, self.train_micro_batch_size, self.max_tokens)
                b["old_logprobs"] = torch.zeros_like(b["rollout_logprobs"])
                for chunk, lp in zip(chunks, self.engine.forward_all(chunks, self._behaviour)):
                    b["old_logprobs"][chunk["row"], : lp.shape[-1]] = lp.to(b["old_logprobs"].device)
        steps = mini_batch_steps(
            self.buffer, self.algorithm, self.seed, self.iteration, self.prompts_per_iteration
        )
        for parts in steps:
            for part in parts:
                self._train_on(part, metrics)
            self.step(metrics)

    def _behaviour(self, policy: LMPolicy, mb: TensorDict) -> torch.Tensor:
        return behaviour_logprobs(policy, mb, self.temperature)
