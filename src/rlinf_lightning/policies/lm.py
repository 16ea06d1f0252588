"""LMPolicy: a causal language model loaded with ``from_pretrained`` from a local directory."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.batch import (
    LOSS_MASK,
    PAD_TO_MULTIPLE_OF,
    left_padded_to_multiple,
    multiple_problems,
)
from rlinf_lightning.kernels.chunked_head import (
    LOGIT_CHUNK_TOKENS,
    LogitMap,
    chunked_logprobs,
    head_mismatch,
)
from rlinf_lightning.kernels.fused_decoder import adapt_for_training
from rlinf_lightning.policies.lora import LoRA, lora_problems
from rlinf_lightning.policies.module import DTYPES, RLModule, anneal_problems, annealed, compile_blocks

if TYPE_CHECKING:
    from rlinf_lightning.policies.model_dir import CausalLMShape


#: the largest attention scores (batch x heads x tokens x tokens, in float32 bytes) for which a bf16
#: training forward on CPU takes the math attention kernel (see ``LMPolicy.training_attention``)
MATH_ATTENTION_MAX_BYTES = 256 * 2**20


#: rows of a micro-batch whose entropy (for the log, without gradient) is computed at once: its
#: vocabulary-sized temporaries (probabilities, their product with the log-probs) exist for this
#: many rows only
ENTROPY_CHUNK_ROWS = 8


def response_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_len: int,
    temperature: float,
    entropy: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each of the last ``response_len`` tokens given everything before it, and, from
    the same log-softmax, the entropy of each position's distribution: ``entropy="grad"`` with its
    gradient (an entropy bonus), ``"value"`` without (for the log), ``None`` not at all.

    One log-softmax over the whole micro-batch: chunking it by rows is slower on a GPU
    (docs/benchmarks.md; each chunk's backward writes a zero-filled gradient of the whole logits tensor), and
    saves no memory in training, since autograd keeps the log-softmax for the backward either
    way. The logged entropy is computed ``ENTROPY_CHUNK_ROWS`` rows at a time, so its temporaries
    stay the size of a chunk. Under bf16 autocast the logits are bf16 and the log-softmax writes
    float32 (its ``dtype`` converts them first: PyTorch fuses that conversion into the kernel for
    float16 only), and a temperature of 1 divides nothing (on a GPU each extra pass is one over the
    step's largest tensor, and another in the backward: ``docs/gpu.md``)."""
    logits = logits[:, -response_len - 1 : -1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    logp = log_probs.gather(-1, input_ids[:, -response_len:].unsqueeze(-1)).squeeze(-1)
    if entropy == "grad":
        return logp, -(log_probs.exp() * log_probs).sum(-1)
    if entropy == "value":
        with torch.no_grad():
            chunks = log_probs.detach().split(ENTROPY_CHUNK_ROWS)
            return logp, torch.cat([-(c.exp() * c).sum(-1) for c in chunks])
    return logp, None


class LMPolicy(RLModule):
    """A Hugging Face causal LM as an RL policy.

    Args:
        model_path: directory with ``config.json``, weights and tokenizer (``from_pretrained``).
        lr: AdamW learning rate.
        anneal_lr_steps: decay the learning rate linearly to 0 over this many optimizer steps
            (iterations x updates per batch); ``None`` keeps it constant.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_grad_norm: clip the global gradient norm to this before each step (0 disables).
        dtype: parameter dtype (``float32``; ``bfloat16`` on GPU).
        lora: train low-rank adapters instead of every weight (``{rank: 8, alpha: 16}``; see
            :class:`~rlinf_lightning.policies.lora.LoRA`); ``None``: full fine-tuning.
        gradient_checkpointing: recompute each decoder layer's activations in the backward instead
            of keeping them (less memory for about one more forward); ``None``: the actor decides
            from its token budget (``flow.budget``), off where no budget is computed.
        logit_chunk_tokens: the response log-probs go through the lm head this many tokens at a
            time, the logits recomputed in the backward (``kernels.chunked_head``), so the whole
            micro-batch's logits never exist; ``None``: whole logits (one log-softmax). Loading
            checks that the chunks compute the model's own logits (with the scale or soft cap its
            config gives them), and refuses a model whose logits they would not. An lm head with
            LoRA adapters takes the whole logits.
        pad_to_multiple_of: each forward over a micro-batch runs at a width (tokens per row)
            rounded up to a multiple of this, with masked columns on the prompts' side, so that
            forwards meet few shapes (``flow.batch.PAD_TO_MULTIPLE_OF`` says why); ``None``: at
            the micro-batch's own width.
    """

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-6,
        anneal_lr_steps: int | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        dtype: str = "float32",
        lora: LoRA | None = None,
        gradient_checkpointing: bool | None = None,
        logit_chunk_tokens: int | None = LOGIT_CHUNK_TOKENS,
        pad_to_multiple_of: int | None = PAD_TO_MULTIPLE_OF,
    ) -> None:
        super().__init__()
        self.model_path = str(model_path)
        self.lr = lr
        self.anneal_lr_steps = anneal_lr_steps
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.max_grad_norm = max_grad_norm
        self.dtype = dtype
        self.lora = lora
        self.gradient_checkpointing = gradient_checkpointing
        self.logit_chunk_tokens = logit_chunk_tokens
        self.pad_to_multiple_of = pad_to_multiple_of
        self.model: torch.nn.Module | None = None
        self.compiled_head = False  # set by compile_model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype))
        adapt_for_training(self.model)
        if self.logit_chunk_tokens and (problem := head_mismatch(self.model, LogitMap.of(self.model.config))):
            fix = "set it to null (whole logits) for this model"
            raise ValueError(f"policy.logit_chunk_tokens: {problem}; {fix}")
        if self.gradient_checkpointing:  # None (the budget decides) turns it on later, if at all
            enable_gradient_checkpointing(self.model)

    def compile_model(self) -> None:
        """The decoder's layers and the chunked head's per-chunk math under ``torch.compile``
        (``kernels.chunked_head``): with the layers' element-wise work fused, the head's passes
        over each chunk's logits would be the eager part left."""
        compile_blocks(self.model)
        self.compiled_head = True

    def meta_model(self) -> None:
        """The architecture from config.json alone (no weights read)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
        adapt_for_training(self.model)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        assert self.model is not None, "configure_model() first"
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        optimizer = torch.optim.AdamW(
            trainable, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, fused=True
        )  # fused: one kernel over every parameter instead of a Python loop per tensor
        return annealed(optimizer, self.anneal_lr_steps)

    def save_pretrained(self, path: str | Path) -> Path:
        """The model and its tokenizer as a ``from_pretrained`` directory at ``path``."""
        assert self.model is not None, "configure_model() first"
        self.model.save_pretrained(path)
        self.load_tokenizer().save_pretrained(path)
        return Path(path)

    def parameter_count(self) -> int | None:
        """From ``model_path``'s config.json alone (a meta-device model; no weights read, cached)."""
        shape = self.architecture()
        return None if shape is None else shape.parameters

    def architecture(self) -> CausalLMShape | None:
        """Parameters and attention shape (:class:`~rlinf_lightning.policies.model_dir.CausalLMShape`)
        from ``model_path``'s config.json, or ``None`` without one."""
        from rlinf_lightning.policies.model_dir import causal_lm_shape

        return causal_lm_shape(self.model_path)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def forward_logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens. In a training forward (autograd on) it also logs
        ``entropy``: the mean per-token entropy of the sampling distribution over the response
        (exact, from the log-softmax the log-probs come from), which RL dashboards watch for
        collapse. ``with_entropy``: also return the per-token entropy with its gradient (for an
        entropy bonus). No key/value cache: nothing decodes after this forward, and without one
        a no-grad forward frees each layer's keys and values as it goes."""
        response = batch[LOSS_MASK]
        ids, mask = left_padded_to_multiple(
            batch["input_ids"], batch["attention_mask"], self.pad_to_multiple_of
        )
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        want = "grad" if with_entropy else "value" if torch.is_grad_enabled() else None
        head = self.model.get_output_embeddings()
        if self.logit_chunk_tokens and isinstance(head, torch.nn.Linear) and not _sharded(head.weight):
            with self.training_attention(ids):  # the decoder's last hidden states; logits of one token
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    output_hidden_states=True,
                    logits_to_keep=1,
                    use_cache=False,
                )
            hidden = out.hidden_states[-1][:, -response.shape[-1] - 1 : -1]
            del out
            targets = ids[:, -response.shape[-1] :]
            logp, entropy = chunked_logprobs(
                hidden,
                head,
                targets,
                temperature,
                self.logit_chunk_tokens,
                entropy=want is not None,
                compiled=self.compiled_head,
                logit_map=LogitMap.of(self.model.config),
            )
            entropy = entropy.detach() if want == "value" else entropy
        else:
            with self.training_attention(ids):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
                logits = out.logits
            logp, entropy = response_logprobs(logits, ids, response.shape[-1], temperature, want)
        if entropy is not None:
            self.log("entropy", (entropy.detach() * response).sum() / response.sum().clamp_min(1.0))
        return (logp, entropy) if with_entropy else logp

    def training_attention(self, ids: torch.Tensor) -> contextlib.AbstractContextManager:
        """The attention kernel of a forward over ``ids``: PyTorch's default (flash attention),
        except in a bf16 training forward on CPU. There flash attention's backward is far slower
        than its forward (figures in docs/benchmarks.md), while the math kernel's backward is
        batched matmuls. Its B x heads x T x T scores are materialised, so
        it is taken only while they stay under ``MATH_ATTENTION_MAX_BYTES``. In float32 flash
        attention stays (the math kernel is slower there), and so do the rollout's and
        the inference stage's forwards, which have no backward."""
        bf16 = (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16) or (
            self.model.dtype == torch.bfloat16
        )
        if not (torch.is_grad_enabled() and ids.device.type == "cpu" and bf16):
            return contextlib.nullcontext()
        heads = getattr(self.model.config, "num_attention_heads", 1)
        if ids.shape[0] * heads * ids.shape[-1] ** 2 * 4 > MATH_ATTENTION_MAX_BYTES:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)

    def train_flops(self, batch: TensorDict) -> float:
        return causal_lm_train_flops(self.model, batch["attention_mask"])

    def check_state_dict(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why ``state`` (e.g. a checkpoint's weights) cannot load into this policy, or ``None``."""
        from rlinf_lightning.policies.model_dir import config_shapes, shape_difference

        difference = shape_difference(
            config_shapes(self.model_path), {k: list(v.shape) for k, v in state.items()}
        )
        return None if difference is None else f"its weights do not fit {self.model_path} ({difference})"

    def validate_config(self) -> list[tuple[str, str]]:
        """(key, problem) pairs found without loading anything; empty when the config is fine."""
        from rlinf_lightning.policies.model_dir import check_causal_lm_dir

        problems = [("model_path", msg) for msg in check_causal_lm_dir(self.model_path)]
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        problems += anneal_problems(self.anneal_lr_steps)
        if self.dtype not in DTYPES:
            problems.append(("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}"))
        problems += lora_problems(self)
        if self.logit_chunk_tokens is not None and self.logit_chunk_tokens < 1:
            problems.append(("logit_chunk_tokens", f"must be >= 1 or null, got {self.logit_chunk_tokens}"))
        problems += multiple_problems(self.pad_to_multiple_of)
        return problems


def causal_lm_train_flops(model: torch.nn.Module, attention_mask: torch.Tensor) -> float:
    """Model FLOPs of one forward and backward of a decoder-only LM over the real (unpadded) tokens
    of ``attention_mask`` ``[B, T]`` (PaLM's count: ``6 N`` per token for the matmul parameters
    ``N`` plus causal attention, ``6 L d`` per token per earlier token; see ``engines.flops``)."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = getattr(config, "tie_word_embeddings", False)
    matmul_params = params if tied else params - embedding  # a tied embedding is the output matmul
    lengths = attention_mask.sum(-1).double()
    tokens = float(lengths.sum())
    attention = 6.0 * config.num_hidden_layers * config.hidden_size * float((lengths**2).sum())
    return 6.0 * matmul_params * tokens + attention


def _sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is an FSDP2 shard (a ``DTensor``): only the root's forward gathers it, so
    the chunked head, which reads it after that forward, takes the whole logits instead."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """``transformers``' activation checkpointing of every decoder layer, non-reentrant (it needs
    no input that requires grad, so it works with a frozen base under LoRA). Active in training
    mode only: rollouts and the reference model run as before."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
