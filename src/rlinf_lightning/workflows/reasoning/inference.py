"""The inference stage: recomputes old and reference log-probs before the update."""

from __future__ import annotations

import copy
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.flow.memory import weights_part
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.policies.lm import LMPolicy


class InferenceStage(Stage):
    """Reference-policy log-probs for the KL penalty; passes batches through when KL is off."""

    name = "inference"
    cost_hint = 0.3
    in_keys = ("input_ids", "attention_mask", "response_mask")
    out_keys = ("ref_logprobs",)

    def __init__(self, policy: LMPolicy, algorithm: Any, temperature: float) -> None:
        self.policy, self.algorithm, self.temperature = policy, algorithm, temperature

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The reference weights in the policy's dtype (nothing when the algorithm has no KL term).
        Not counted: a forward's activations and logits."""
        if not self.algorithm.needs_reference:
            return []
        n = self.policy.parameter_count()
        return None if n is None else [weights_part(n, self.policy.dtype, "reference weights")]

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
        if self.ref is not None:
            ref = self.ref.forward_logprobs(batch.to(self.device), self.temperature)
            batch["ref_logprobs"] = ref.cpu()  # channels carry host tensors
        return batch
