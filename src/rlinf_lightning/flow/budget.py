"""The actor's peak memory as a function of its token budget, and the budget that fits a device.

A training step holds, besides the train engine's state (weights, gradients, optimizer moments:
``TrainStage.memory``), what the forward saves for the backward, per token of the micro-batch, and
the logits. Counted from first principles for a ``transformers`` decoder layer (Qwen2 / Llama
layout: RMSNorm, q/k/v/o projections with RoPE, SDPA, SwiGLU MLP), with the residual stream in the
weights' dtype (``r`` bytes) and the matmuls in the compute dtype (``c``: 2 under bf16 autocast):

* each RMSNorm keeps its input and its normalised output: ``2 r h``, twice a layer (on CUDA, where
  ``kernels.fused_decoder`` runs it as one fused kernel, its input and a scale a row: the count
  below overestimates there by ``r h`` a norm);
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
vocabulary. Chunked: ``16 V`` bytes a token of one chunk, whatever the budget; ``24 V`` where the
model scales or caps its logits (Gemma 2, Granite, Cohere: the mapped logits and the map's
derivative in float32; what a CPU measured: docs/benchmarks.md).

Checked, not fitted, against the unchunked actor on an H200 (Qwen2.5-0.5B shape, bf16 autocast,
AdamW; ``tests/test_budget.py``; the peaks measured: docs/gpu.md).

The two other stages that run the model over whole micro-batches, from the same pieces:

* the critic (:func:`critic_cost`) trains like the actor, but its head is one value per token:
  the final hidden state and a scalar instead of the vocabulary's logits;
* the inference stage (:func:`inference_cost`: reference log-probs, a forward under ``no_grad``)
  keeps no activations for a backward. What lives is the layer running (at most what it would
  save, above), the hidden states the chunked head reads (every layer's output:
  ``output_hidden_states``, ``(layers + 1) r h``; the forward fills no key/value cache), then the
  logits: whole, the forward's ``c V`` and the float32 log-softmax of the response with its
  input's copy (``8 V R``); chunked, one chunk's logits and log-softmax, a constant. Measured on a
  CPU (float32, hidden 256, 4 layers, the 151,936 vocabulary, 64 rows of up to 128 tokens, the
  stage's call alone): 1.47 GiB chunked (predicted 1.51), 9.48 GiB whole (predicted 9.52).

Each stage then takes its budget the one way :func:`fit_tokens` says.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the share of a device's memory the budget may plan to fill (the rest: allocator fragmentation,
#: the CUDA context, the process itself)
DEVICE_FRACTION = 0.8
#: below this many tokens per micro-batch the matmuls get small; the budget turns activation
#: checkpointing on (where ``policy.gradient_checkpointing`` is unset) rather than go lower
USEFUL_TOKENS = 8192


def gib(nbytes: float) -> str:
    """``"45.1 GiB"``."""
    return f"{nbytes / 2**30:.1f} GiB"


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
            keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
            return cls(*(cfg[k] for k in keys))
        except KeyError:
            return None


@dataclass(frozen=True)
class StepCost:
    """Peak bytes of a stage's call over a micro-batch: ``static + per_token x tokens + fixed``."""

    static: float  # the stage's state (weights; a train engine's gradients and optimizer moments)
    per_token: float  # activations (kept for the backward, or live), whole logits where not chunked
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


def _trained_body(shape: LayerShape, residual: int, compute: int, checkpointing: bool) -> int:
    """Bytes a token of a training step keeps through the decoder: every layer's saved tensors (or
    its input under activation checkpointing), the backward's working layer and the final norm."""
    layer = layer_bytes(shape, residual, compute)
    kept = shape.layers * (residual * shape.hidden if checkpointing else layer)
    return kept + layer + 3 * residual * shape.hidden


def _logits(shape: LayerShape, compute: int, response_fraction: float, backward: bool) -> float:
    """Bytes a token of whole logits costs at their peak (module docstring)."""
    # the forward's logits, and the log-softmax's output and its input's contiguous copy (the
    # figures measured: docs/benchmarks.md)
    forward = compute * shape.vocab + 8 * shape.vocab * response_fraction
    if not backward:
        return forward
    # in float32 the whole logits' gradient (4 V a token) is written while the log-softmax's
    # backward still holds its three, so the gradient adds to them
    grads = 12 * shape.vocab * response_fraction + (4 * shape.vocab if compute >= 4 else 0)
    return max(forward, grads)


def actor_cost(
    shape: LayerShape,
    static: float,
    *,
    residual: int = 4,
    compute: int = 2,
    checkpointing: bool = False,
    logit_chunk: int | None = None,
    mapped_logits: bool = False,
    response_fraction: float = 1.0,
) -> StepCost:
    """The cost model of one actor step (module docstring). ``residual`` / ``compute``: bytes of the
    weights' and the matmuls' dtype; ``mapped_logits``: the model scales or caps its logits
    (``kernels.chunked_head.LogitMap``); ``response_fraction``: response tokens over all tokens."""
    per_token: float = _trained_body(shape, residual, compute, checkpointing)
    fixed = 0.0
    if logit_chunk:
        per_token += residual * shape.hidden + 4  # the chunks' inputs and each token's log-sum-exp
        fixed = (24.0 if mapped_logits else 16.0) * shape.vocab * logit_chunk
    else:
        per_token += _logits(shape, compute, response_fraction, backward=True)
    return StepCost(static, per_token, fixed)


def critic_cost(
    shape: LayerShape, static: float, *, residual: int = 4, compute: int = 2, checkpointing: bool = False
) -> StepCost:
    """One step of a value model (``policies.ValueModel``): the actor's decoder, and a value head
    that keeps the final hidden state and one float32 value (and its gradient) a token."""
    per_token = _trained_body(shape, residual, compute, checkpointing) + residual * shape.hidden + 8
    return StepCost(static, per_token, 0.0)


def inference_cost(
    shape: LayerShape,
    static: float,
    *,
    dtype: int = 4,
    logit_chunk: int | None = None,
    mapped_logits: bool = False,
    response_fraction: float = 1.0,
) -> StepCost:
    """A forward without gradients (the inference stage's reference log-probs) in the weights'
    dtype (``dtype`` bytes: no autocast): the layer running, every layer's output and the logits
    (module docstring)."""
    per_token: float = layer_bytes(shape, dtype, dtype)
    fixed = 0.0
    if logit_chunk:  # every layer's output (``output_hidden_states``), the head's input and result
        per_token += (shape.layers + 2) * dtype * shape.hidden + 4
        # one chunk's logits and log-softmax (and their float32 map)
        fixed = (dtype + (8.0 if mapped_logits else 4.0)) * shape.vocab * logit_chunk
    else:  # the residual stream in and out of the layer running, then the logits
        per_token += 2 * dtype * shape.hidden + _logits(shape, dtype, response_fraction, backward=False)
    return StepCost(static, per_token, fixed)


@dataclass(frozen=True)
class Budget:
    """A chosen token budget: its tokens, whether it needs activation checkpointing, its peak."""

    tokens: int
    checkpointing: bool
    peak: float
    checkpointing_chosen: bool = False  # turned on by the budget, not by policy.gradient_checkpointing
    cuts: bool = True  # fewer tokens than the stage's micro-batch (else it runs whole, as before)


def choose_budget(
    costs: dict[bool, StepCost], left: float, batch_tokens: int, sample_tokens: int
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


def fit_tokens(
    stage: str,
    key: str,
    costs: dict[bool, StepCost],
    usable: float,
    batch_tokens: int,
    sample: int,
    fixes: str,
) -> Budget | tuple[str, str]:
    """The token budget of ``stage`` (its name, for the log and the message) within ``usable``
    bytes (:func:`choose_budget`), logged; or ``(key, problem)`` naming its budget's config key
    when not one ``sample`` fits, with ``fixes`` (what else would make it fit)."""
    budget = choose_budget(costs, usable, batch_tokens, sample)
    if budget is None:
        peak = min(cost.peak(sample) for cost in costs.values())
        return key, (
            f"not one sample of {sample} tokens fits the {stage}'s device: it alone would peak at "
            f"{gib(peak)} with {gib(usable)} usable; {fixes}"
        )
    log.info(
        "%s: token budget %s per micro-batch (predicted peak %s of %s usable%s)",
        stage, f"{budget.tokens:,}", gib(budget.peak), gib(usable),
        "; activation checkpointing on" if budget.checkpointing else "",
    )  # fmt: skip
    return budget
