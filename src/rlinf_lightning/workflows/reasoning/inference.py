"""The inference stage: recomputes old and reference log-probs before the update."""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.budget import Budget, LayerShape, StepCost, inference_cost
from rlinf_lightning.flow.memory import dtype_bytes, weights_part
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.flow.token_budget import TokenBudget
from rlinf_lightning.kernels.chunked_head import LogitMap
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.workflows.padding import token_budget_split
from rlinf_lightning.workflows.specs import NO_BUDGET, BudgetSpec, RolloutSpec, RunSpec


class InferenceStage(TokenBudget, Stage):
    """Reference-policy log-probs for the KL penalty; passes batches through when KL is off.

    A message runs in one forward, or in micro-batches of at most ``max_tokens`` tokens
    (``task.inference_max_tokens_per_micro_batch``); unset, the plan's memory check chooses the
    budget (:class:`TokenBudget`) from a forward's cost (``flow.budget.inference_cost``: no
    gradients, so far more tokens than the actor's step), and cuts only what does not fit."""

    name = "inference"
    cost_hint = 0.3
    in_keys = ("input_ids", "attention_mask", LOSS_MASK)
    out_keys = ("ref_logprobs",)
    budget_key = "task.inference_max_tokens_per_micro_batch"
    budget_fixes = "use a smaller model, policy.logit_chunk_tokens=1024 or more devices"
    working_what = "a forward's activations and logits"

    def __init__(
        self, policy: LMPolicy, run: RunSpec, rollout: RolloutSpec, budget: BudgetSpec = NO_BUDGET
    ) -> None:
        self.policy, self.algorithm, self.temperature = policy, run.algorithm, rollout.temperature
        self.max_tokens, self.max_prompt_tokens = budget.max_tokens, rollout.max_prompt_tokens
        self.horizon = rollout.horizon

    def memory(
        self, device: str, replicas: int, micro_batch: int, budget: Budget | None = None
    ) -> list[MemoryPart] | None:
        """The reference weights in the policy's dtype and, under a token budget (configured, or
        ``budget``: the plan's), a forward's working memory at its peak (nothing when the algorithm
        has no KL term)."""
        return self.with_working(device, self.budget_state(device, replicas, micro_batch), budget)

    def budget_configured(self) -> bool:
        return not self.algorithm.needs_reference  # no reference: no forward to size

    def budget_state(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        if not self.algorithm.needs_reference:
            return []
        n = self.policy.parameter_count()
        return None if n is None else [weights_part(n, self.policy.dtype, "reference weights")]

    def budget_cost(self, device: str, static: float, checkpointing: bool) -> StepCost | None:
        shape = LayerShape.from_dir(self.policy.model_path)
        if shape is None:
            return None
        prompt = self.max_prompt_tokens or 0
        return inference_cost(
            shape,
            static,
            dtype=dtype_bytes(self.policy.dtype),  # the reference runs in its dtype, no autocast
            logit_chunk=self.policy.logit_chunk_tokens,
            mapped_logits=not LogitMap.from_dir(self.policy.model_path).identity,
            response_fraction=self.horizon / (prompt + self.horizon),
        )

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        if self.max_tokens:
            return f"micro-batches of at most {self.max_tokens} tokens", (self.budget_key,)
        keys = (self.budget_key, "trainer.micro_batch_size")
        return f"messages of {micro_batch} samples in one forward", keys

    def setup(self, ctx: StageContext) -> None:
        self.ref, self.device = None, ctx.device
        if self.algorithm.needs_reference:
            self.ref = copy.deepcopy(self.policy)
            self.ref.configure_model()
            self.ref.to(ctx.device).eval().requires_grad_(False)
            self._offloader = Offloader(ctx.device)

    def onload(self) -> None:
        if self.ref is not None:
            self._offloader.onload(self.ref)

    def offload(self) -> None:
        if self.ref is not None:
            self._offloader.offload(self.ref)

    @torch.no_grad()
    def process(self, batch: TensorDict) -> TensorDict:
        if self.ref is None:
            return batch
        if not self.max_tokens:  # the whole message at once
            batch["ref_logprobs"] = self.ref.forward_logprobs(batch.to(self.device), self.temperature).cpu()
            return batch
        ref = torch.zeros(batch[LOSS_MASK].shape, dtype=torch.float32)
        batch["row"] = torch.arange(len(batch))
        for chunk in token_budget_split(batch, self.max_tokens):
            lp = self.ref.forward_logprobs(chunk.to(self.device), self.temperature)
            ref[chunk["row"], : lp.shape[-1]] = lp.float().cpu()  # channels carry host tensors
        del batch["row"]
        batch["ref_logprobs"] = ref
        return batch
