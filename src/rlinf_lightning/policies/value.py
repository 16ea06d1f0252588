"""ValueModel: a critic for PPO on a language model, the policy's transformer with a scalar head.

As in InstructGPT, veRL and RLinf, the value model is a second network trained beside the policy,
with its own optimizer: a causal LM's backbone (``AutoModel``: the decoder without its LM head)
read from ``model_path`` (the policy's own by default) and one linear layer from the last hidden
state to a value. The head starts at zero, so every run and every process begins from the same
critic (predicting 0) whatever its random state.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.batch import (
    LOSS_MASK,
    PAD_TO_MULTIPLE_OF,
    left_padded_to_multiple,
    multiple_problems,
)
from rlinf_lightning.kernels.fused_decoder import adapt_for_training
from rlinf_lightning.policies.lm import enable_gradient_checkpointing
from rlinf_lightning.policies.module import DTYPES, RLModule, compile_blocks


class ValueNetwork(torch.nn.Module):
    """``backbone`` (a transformer returning hidden states) and ``head`` (hidden -> 1)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1, dtype=backbone.dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids, response_len: int) -> torch.Tensor:
        """``[B, response_len, 1]``: the value of each response token's state, read from the hidden
        state of the position before it. One call of the network itself, so that what wraps it
        (FSDP2's root, which gathers the embedding, final norm and head) sees the forward; a fresh
        tensor, not a view (an FSDP2 root's output must not be)."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.head(out.last_hidden_state[:, -response_len - 1 : -1])


class ValueModel(RLModule):
    """The critic of token-level PPO (``task.critic`` of a ``MathTask``).

    Args:
        model_path: the causal LM whose backbone it starts from (``None``: the policy's
            ``model_path``, as InstructGPT starts its value model from a trained model).
        lr: AdamW learning rate of the critic (its own optimizer).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_grad_norm: clip the critic's global gradient norm to this before each step (0: no clip).
        dtype: parameter dtype (``float32``; ``bfloat16`` on GPU).
        train_micro_batch_size: samples per forward/backward of the critic (``None``: the task's
            ``train_micro_batch_size``).
        gradient_checkpointing: recompute each decoder layer's activations in the backward instead
            of keeping them; ``None``: the critic stage decides from its token budget
            (``flow.budget``), off where no budget is computed.
        pad_to_multiple_of: each forward runs at a width rounded up to a multiple of this, with
            masked columns on the prompts' side (``None``: its own width); as the policy's.
    """

    def __init__(
        self,
        model_path: str | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        dtype: str = "float32",
        train_micro_batch_size: int | None = None,
        gradient_checkpointing: bool | None = None,
        pad_to_multiple_of: int | None = PAD_TO_MULTIPLE_OF,
    ) -> None:
        super().__init__()
        self.model_path = None if model_path is None else str(model_path)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.max_grad_norm, self.dtype = max_grad_norm, dtype
        self.train_micro_batch_size = train_micro_batch_size
        self.gradient_checkpointing = gradient_checkpointing
        self.pad_to_multiple_of = pad_to_multiple_of
        self.model: ValueNetwork | None = None

    def for_policy(self, model_path: str) -> ValueModel:
        """This critic with ``model_path`` filled in from the policy's when it names none."""
        if self.model_path is not None:
            return self
        options = (
            "lr",
            "weight_decay",
            "betas",
            "max_grad_norm",
            "dtype",
            "train_micro_batch_size",
            "gradient_checkpointing",
            "pad_to_multiple_of",
        )
        return type(self)(model_path, **{k: getattr(self, k) for k in options})

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype))
        adapt_for_training(backbone)
        if self.gradient_checkpointing:  # None (the budget decides) turns it on later, if at all
            enable_gradient_checkpointing(backbone)
        self.model = ValueNetwork(backbone, backbone.config.hidden_size)

    def compile_model(self) -> None:
        """The backbone's layers under ``torch.compile`` (its forward passes no key/value cache)."""
        compile_blocks(self.model)

    def meta_model(self) -> None:
        from transformers import AutoConfig, AutoModel

        backbone = AutoModel.from_config(AutoConfig.from_pretrained(self.model_path))
        adapt_for_training(backbone)
        self.model = ValueNetwork(backbone, backbone.config.hidden_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() first"
        return torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay
        )

    def parameter_count(self) -> int | None:
        """The policy architecture's count from ``model_path``'s config.json (no weights read): the
        backbone plus a head of ``hidden + 1``, less an untied LM head, is within a few percent."""
        from rlinf_lightning.policies.model_dir import causal_lm_shape

        shape = causal_lm_shape(self.model_path) if self.model_path else None
        return None if shape is None else shape.parameters

    def forward_values(self, batch: TensorDict) -> torch.Tensor:
        """``[B, R]`` float32: the value of each response token's state, read from the hidden state
        of the position before it (where the policy's logits for that token come from)."""
        response = batch[LOSS_MASK]
        ids, mask = left_padded_to_multiple(
            batch["input_ids"], batch["attention_mask"], self.pad_to_multiple_of
        )
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        return self.model(ids, mask, pos, response.shape[-1]).squeeze(-1).float()

    def validate_config(self) -> list[tuple[str, str]]:
        """(key, problem) pairs found without loading anything."""
        from rlinf_lightning.policies.model_dir import check_causal_lm_dir

        problems = []
        if self.model_path is not None:
            problems += [("model_path", msg) for msg in check_causal_lm_dir(self.model_path)]
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if self.weight_decay < 0:
            problems.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(("betas", f"must be two numbers in [0, 1), got {list(self.betas)}"))
        if self.max_grad_norm < 0:
            problems.append(("max_grad_norm", f"must be >= 0 (0: no clip), got {self.max_grad_norm}"))
        if self.dtype not in DTYPES:
            problems.append(("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}"))
        if self.train_micro_batch_size is not None and self.train_micro_batch_size < 1:
            problems.append(("train_micro_batch_size", f"must be >= 1, got {self.train_micro_batch_size}"))
        problems += multiple_problems(self.pad_to_multiple_of)
        return problems
