"""The actor's peak memory as a function of its token budget, and the budget that fits a device.

A training step holds, besides the train engine's state (weights, gradients, optimizer moments:
``TrainStage.memory``), what the forward saves for the backward, per token of the micro-batch, and
the logits. Counted from first principles for a ``transformers`` decoder layer (Qwen2 / Llama
layout: RMSNorm, q/k/v/o projections with RoPE, SDPA, SwiGLU MLP), with the residual stream in the
weights' dtype (``r`` bytes) and the matmuls in the compute dtype (``c``: 2 under bf16 autocast):

* each RMSNorm keeps its input and its normalised output: ``2 r h``, twice a layer;
* the projections keep their (autocast-cast) inputs: ``3 c h`` for q/k/v, ``c h`` for o, ``2 c h``
  for gate/up (``r h`` shared when nothing is cast);
* attention (flash / memory-efficient SDPA) keeps q, k and v (k and v repeated to every head) and
  its output: ``4 c h``;
* the MLP keeps gate, its SiLU, up and their product: ``4 c i``;

so ``36 h + 8 i`` bytes a token a layer under bf16 autocast over float32 weights (Qwen2.5-0.5B:
71 KB), plus one layer's worth again for the backward's working gradients. With activation
checkpointing a layer keeps only its input (``r h``) and one layer is recomputed at a time.

Logits, whole (``policy.logit_chunk_tokens=None``): the forward writes ``c V`` a token, and the
float32 log-softmax of the response tokens (``R``) is kept; its backward holds the kept output,
the incoming and the outgoing gradients at once: ``12 V R`` bytes, the step's peak on a large
vocabulary. Chunked: ``16 V`` bytes a token of one chunk, whatever the budget.

Checked, not fitted, against the unchunked actor on an H200 (Qwen2.5-0.5B shape, bf16 autocast,
AdamW; ``tests/test_budget.py``): 61.8 GiB at 16,384 tokens and 111.5 GiB at 32,768.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: the share of a device's memory the budget may plan to fill (the rest: allocator fragmentation,
#: the CUDA context, the process itself)
DEVICE_FRACTION = 0.8
#: below this many tokens per micro-batch the matmuls get small; the budget turns activation
#: checkpointing on (where ``policy.gradient_checkpointing`` is unset) rather than go lower
USEFUL_TOKENS = 8192


@dataclass(frozen=True)
class LayerShape:
    """What the per-token model reads from a causal LM's config.json."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def from_dir(cls, model_path: str | Path) -> LayerShape | None:
        """From ``model_path/config.json`` (its text config for a multimodal one); ``None`` without."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        cfg = cfg.get("text_config", cfg)
        try:
            return cls(
                cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
            )
        except KeyError:
            return None


@dataclass(frozen=True)
class ActorCost:
    """Peak bytes of an actor step: ``static + per_token x tokens + fixed``."""

    static: float  # the train engine's state (weights, gradients, optimizer moments)
    per_token: float  # activations kept for the backward, and whole logits where not chunked
    fixed: float  # one chunk's logits

    def peak(self, tokens: int) -> float:
        return self.static + self.per_token * tokens + self.fixed

    def tokens_within(self, nbytes: float) -> int:
        """The most tokens whose peak stays within ``nbytes`` (0 when not even the state fits)."""
        return max(0, int((nbytes - self.static - self.fixed) // self.per_token))


def layer_bytes(shape: LayerShape, residual: int, compute: int) -> int:
    """Bytes a token one decoder layer keeps for the backward (module docstring)."""
    h, i = shape.hidden, shape.intermediate
    cast = compute < residual
    norms = 2 * (2 * residual * h)
    inputs = (
        (3 * compute * h if cast else residual * h)
        + compute * h
        + (2 * compute * h if cast else residual * h)
    )
    return norms + inputs + 4 * compute * h + 4 * compute * i


def actor_cost(
    shape: LayerShape,
    static: float,
    *,
    residual: int = 4,
    compute: int = 2,
    checkpointing: bool = False,
    logit_chunk: int | None = None,
    response_fraction: float = 1.0,
) -> ActorCost:
    """The cost model of one actor step (module docstring). ``residual`` / ``compute``: bytes of the
    weights' and the matmuls' dtype; ``response_fraction``: response tokens over all tokens."""
    layer = layer_bytes(shape, residual, compute)
    kept = shape.layers * (residual * shape.hidden if checkpointing else layer)
    per_token = kept + layer + 3 * residual * shape.hidden  # + the backward's working layer, final norm
    fixed = 0.0
    if logit_chunk:
        per_token += residual * shape.hidden + 4  # the chunks' inputs and each token's log-sum-exp
        fixed = 16.0 * shape.vocab * logit_chunk
    else:
        forward = compute * shape.vocab + (8 if compute < 4 else 4) * shape.vocab * response_fraction
        # in float32 the whole logits' gradient (4 V a token) is written while the log-softmax's
        # backward still holds its three (measured on a CPU: 6.3 GiB where 12 V R alone gave 4.5)
        backward = 12 * shape.vocab * response_fraction + (4 * shape.vocab if compute >= 4 else 0)
        per_token += max(forward, backward)
    return ActorCost(static, per_token, fixed)


@dataclass(frozen=True)
class Budget:
    """A chosen token budget: its tokens, whether it needs activation checkpointing, its peak."""

    tokens: int
    checkpointing: bool
    peak: float
    checkpointing_chosen: bool = False  # turned on by the budget, not by policy.gradient_checkpointing


def choose_budget(
    costs: dict[bool, ActorCost], left: float, batch_tokens: int, sample_tokens: int
) -> Budget | None:
    """The token budget for ``left`` bytes: the most tokens that fit, at most the whole batch.
    ``costs`` maps activation checkpointing off / on to its cost model (only the configured one
    where ``policy.gradient_checkpointing`` is set). Checkpointing is taken when the budget
    without it would be below :data:`USEFUL_TOKENS` (and the batch) and it fits more. ``None``
    when not even one sample (``sample_tokens``) fits."""
    fits = {on: min(cost.tokens_within(left), batch_tokens) for on, cost in costs.items()}
    on = False not in fits or (
        True in fits and fits[False] < min(USEFUL_TOKENS, batch_tokens) and fits[True] > fits[False]
    )
    if fits[on] < sample_tokens:
        return None
    return Budget(fits[on], on, costs[on].peak(fits[on]))
