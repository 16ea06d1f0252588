"""CriticStage: the value model of token-level PPO, a learning stage of its own.

As RLinf's and veRL's critic workers, the critic is its own group in the plan (collocated with the
others, on slots of its own, or anything between) with its own train engine and optimizer. In the
reasoning flow it takes the advantage stage's place, hosting it:

1. ``process`` (each micro-batch of whole prompt groups, as it arrives): the value of every
   response token's state with the critic's current weights; then the hosted advantage stage
   computes the advantages from them (``gae``: token-level GAE, the outcome reward on the last
   token, a KL in the reward if any); the critic's targets are the advantages plus its values.
   The micro-batch goes on to the actor with ``values``, ``advantage`` and ``returns``;
2. ``end_iteration``: as many optimizer steps on the clipped value loss as the actor takes
   (``ppo_epochs`` x ``num_mini_batches``, the same mini-batches: ``workflows/mini_batches.py``),
   each dividing by its tokens over every replica, so every plan makes the same updates.

Its weights and optimizer state are checkpointed with the run (:meth:`CriticStage.extra_state`).
Its micro-batches are sized like the actor's (``task.critic.train_micro_batch_size``, else the
task's ``train_micro_batch_size`` or ``train_max_tokens_per_micro_batch``); with none of them set
the plan's memory check chooses its token budget (``flow/token_budget.py``) from its own cost
model (``flow.budget.critic_cost``: the actor's decoder under a value head, no vocabulary logits),
with activation checkpointing where the budget without it would be small and
``task.critic.gradient_checkpointing`` is unset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.losses import aggregate, clipped_value_loss, masked_mean
from rlinf_lightning.engines.train import resolve_train_engine
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.budget import Budget, LayerShape, StepCost, critic_cost
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, StageContext
from rlinf_lightning.flow.token_budget import TokenBudget
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.workflows.mini_batches import mini_batch_steps
from rlinf_lightning.workflows.padding import micro_batches
from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec
from rlinf_lightning.workflows.training import TrainStage

if TYPE_CHECKING:
    from rlinf_lightning.workflows.reasoning.advantage import AdvantageStage

#: what the critic keeps of each micro-batch for its update
KEPT = ("input_ids", "attention_mask", LOSS_MASK, "values", "returns", "group_id")


class ValueLoss:
    """``(critic, micro_batch) -> (loss_sum, count, metrics)``: ``vf_coef`` x the clipped value loss
    per response token (around the values the advantages came from), summed over tokens and
    counted per token; picklable, for every rank of the critic's train engine."""

    def __init__(self, value_clip: float | None, vf_coef: float) -> None:
        self.value_clip, self.vf_coef = value_clip, vf_coef

    def __call__(self, critic: ValueModel, mb: TensorDict):
        values, old, returns, mask = (
            critic.forward_values(mb),
            mb["values"],
            mb["returns"],
            mb[LOSS_MASK],
        )
        per_token = clipped_value_loss(values, old, returns, self.value_clip)
        loss_sum, count = aggregate(self.vf_coef * per_token, mask, "token-mean")
        unclipped = 0.5 * (values.detach() - returns) ** 2
        metrics = {
            "value_clip_frac": masked_mean((per_token.detach() > unclipped).float(), mask),
            "value_error": masked_mean(unclipped, mask),
        }
        return loss_sum, count, metrics


def _values_of(critic: ValueModel, mb: TensorDict) -> torch.Tensor:
    return critic.forward_values(mb)


class CriticStage(TokenBudget, TrainStage):
    """Hosts ``critic`` (a :class:`~rlinf_lightning.policies.ValueModel`) in a train engine and
    ``advantage`` (the workflow's ``AdvantageStage``, whose algorithm reads values) within it; see
    the module docstring. ``budget``: its forward/backward sizes; ``rollout``: its samples' groups
    per iteration and longest prompt and response (for a chosen budget)."""

    name = "critic"
    cost_hint = 0.6  # a forward per sample and the update: about the actor's share, less sampling
    out_keys = ("values", "advantage", "returns")
    budget_key = "task.train_max_tokens_per_micro_batch"
    budget_fixes = (
        "use a smaller critic (task.critic.model_path), trainer.precision=bf16-true, "
        "task.critic.gradient_checkpointing=true or more devices"
    )
    working_what = "activations and values"
    offers_checkpointing = True

    def __init__(
        self,
        critic: ValueModel,
        advantage: AdvantageStage,
        run: RunSpec,
        rollout: RolloutSpec,
        budget: BudgetSpec,
    ) -> None:
        super().__init__(critic, run.train)
        self.max_prompt_tokens, self.horizon = rollout.max_prompt_tokens, rollout.horizon
        self.advantage, self.algorithm = advantage, advantage.algorithm
        self.kl_in_reward = advantage.kl_in_reward
        self.in_keys = ("input_ids", "attention_mask", *(k for k in advantage.in_keys if k != "values"))
        self.micro_batch_size, self.max_tokens = budget.micro_batch_size, budget.max_tokens
        self.prompts_per_iteration, self.seed = rollout.prompts, run.seed

    def check_placement(self, replicas: int, own_process: bool) -> list[tuple[str, str]]:
        if resolve_train_engine(self.train_engine, replicas) == "fsdp":
            why = (
                "fsdp runs every forward in lockstep over the ranks, but the critic values each "
                "micro-batch as it arrives, unevenly over its replicas; use ddp or auto with a critic"
            )
            return [("trainer.train_engine", why)]
        return super().check_placement(replicas, own_process)

    def memory(
        self, device: str, replicas: int, micro_batch: int, budget: Budget | None = None
    ) -> list[MemoryPart] | None:
        """The train engine's state and, under a token budget (configured, or ``budget``: the
        plan's), what a step over a micro-batch of that many tokens adds at its peak
        (``flow.budget.critic_cost``)."""
        return self.with_working(device, TrainStage.memory(self, device, replicas, micro_batch), budget)

    def budget_configured(self) -> bool:
        return bool(self.micro_batch_size)

    def budget_state(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        return TrainStage.memory(self, device, replicas, micro_batch)

    def budget_cost(self, device: str, static: float, checkpointing: bool) -> StepCost | None:
        shape = LayerShape.from_dir(self.policy.model_path) if self.policy.model_path else None
        if shape is None:
            return None
        residual, compute = self.step_dtype_bytes(device)
        return critic_cost(shape, static, residual=residual, compute=compute, checkpointing=checkpointing)

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        keys = ("task.critic.train_micro_batch_size", "task.train_micro_batch_size")
        if self.max_tokens:
            tokens = ("task.train_max_tokens_per_micro_batch",)
            return f"micro-batches of at most {self.max_tokens} tokens", tokens
        if self.micro_batch_size:
            return f"micro-batches of {self.micro_batch_size} samples", keys
        keys = (*keys, "trainer.micro_batch_size")
        return f"micro-batches of {micro_batch} samples (the plan's messages)", keys

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.advantage.setup(ctx)
        self.loss = ValueLoss(self.algorithm.value_clip, self.algorithm.vf_coef)
        self.metrics = Metrics()

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.advantage.begin_iteration(iteration)
        self.iteration, self.kept = iteration, []

    def process(self, batch: TensorDict) -> TensorDict:
        mask = batch[LOSS_MASK]
        batch["row"] = torch.arange(len(batch))
        values = torch.zeros(mask.shape, dtype=torch.float32)
        chunks = micro_batches(batch, self.micro_batch_size, self.max_tokens)
        for chunk, v in zip(chunks, self.engine.forward_all(chunks, _values_of)):
            values[chunk["row"], : v.shape[-1]] = v.float().cpu()
        del batch["row"]
        batch["values"] = values * mask
        batch = self.advantage.process(batch)
        batch["returns"] = batch["advantage"] + batch["values"]
        self.metrics.mean("values", float(masked_mean(batch["values"], mask)), len(batch))
        self.metrics.mean("returns", float(masked_mean(batch["returns"], mask)), len(batch))
        self.kept.append(batch.select(*KEPT))
        return batch

    def end_iteration(self) -> Metrics:
        metrics = self.metrics.take().merge(self.advantage.end_iteration())
        steps = mini_batch_steps(
            self.kept, self.algorithm, self.seed, self.iteration, self.prompts_per_iteration
        )
        for parts in steps:
            for part in parts:
                for chunk in micro_batches(part, self.micro_batch_size, self.max_tokens):
                    for k, v in self.engine.accumulate(chunk, self.loss).items():
                        metrics.mean(k, v, len(chunk))
            self.step(metrics)
        self.kept = []
        return metrics

    def sync_state(self) -> None:
        return None  # nothing reads the critic's weights but the critic

    def extra_state(self) -> dict[str, Any]:
        """The critic's weights and optimizer state (replica 0; the others hold the same), and the
        hosted advantage stage's (an adaptive KL coefficient)."""
        return {"engine": self.engine.state_dict(), "advantage": self.advantage.extra_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state["engine"])
        if state["advantage"]:
            self.advantage.load_extra_state(state["advantage"])
