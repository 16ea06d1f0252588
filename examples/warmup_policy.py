"""Bring your own policy: an ``RLModule`` subclass chosen by ``class_path`` from YAML.

    PYTHONPATH=examples rlinf fit --config configs/math_grpo_tiny.yaml \\
        --policy.class_path=warmup_policy.WarmupLMPolicy --policy.init_args.warmup_iterations=50

It keeps ``LMPolicy``'s model loading and log-probs and changes two things, as one would in a
``LightningModule``: ``configure_optimizers`` returns AdamW with a linear warm-up schedule (stepped
once per iteration; its state is checkpointed and resumed), and ``self.log`` records the mean
log-prob of the response tokens the actor trains on, which reaches the loggers as
``actor/policy/response_logprob``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.policies import LMPolicy


class WarmupLMPolicy(LMPolicy):
    """``LMPolicy`` whose learning rate rises linearly over ``warmup_iterations``.

    Args:
        model_path: directory with ``config.json``, weights and tokenizer (``from_pretrained``).
        lr: peak AdamW learning rate, reached after the warm-up.
        warmup_iterations: iterations from ``lr / warmup_iterations`` to ``lr``.
        max_grad_norm: clip the global gradient norm to this before each step (0 disables).
    """

    def __init__(
        self, model_path: str, lr: float = 1e-4, warmup_iterations: int = 20, max_grad_norm: float = 1.0
    ) -> None:
        super().__init__(model_path, lr=lr, max_grad_norm=max_grad_norm)
        self.warmup_iterations = warmup_iterations

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        warmup = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0 / self.warmup_iterations, total_iters=self.warmup_iterations
        )
        return {"optimizer": optimizer, "lr_scheduler": warmup}

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        logprobs = super().forward_logprobs(batch, temperature)
        mask = batch["response_mask"].bool()
        self.log("policy/response_logprob", logprobs.detach()[mask].mean())
        return logprobs
