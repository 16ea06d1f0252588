"""Response log-probs and entropy through the lm head a chunk of tokens at a time.

The whole micro-batch's logits (tokens x vocabulary: 16,384 x 151,936 is 5 GB in bf16, 10 GB as the
float32 log-softmax autograd keeps) never exist: the forward computes each chunk's logits and keeps
nothing of them, and the backward recomputes the chunk's logits to form their gradient, which goes
straight into the hidden states' and the head's gradients. Activation memory per token no longer
scales with the vocabulary; the price is one more head matmul per chunk in the backward
(2 x hidden x vocabulary FLOPs a token, a few percent of a small model's step).

Each pass over a chunk's logits is a pass over the step's largest tensors (a memory-bound kernel on
a GPU: 48 chunks of 1,024 x 151,936 in a 256-sample step of the Qwen2.5-0.5B shape), so the passes
are few: the matmul writes the logits in its dtype once; one log-softmax (forward) or softmax
(backward) computes in float32 (from a float32 copy of bf16 logits: PyTorch fuses that conversion
for float16 only); the gradient of the logits is written once, in the matmul's dtype, with its
target entries set apart. ``benchmarks/actor_bound.py`` counts the bytes of a chunk's forward
(with the logged entropy) and backward under bf16 autocast: 19 GB a chunk of that shape before (a
float32 copy, subtract, exp, multiply and sum; a multiply, scatter, division and cast), 12 GB now.
A temperature other than 1 divides a float32 copy of the logits in the softmaxes and scales the
gradient's multiplier.

The matmuls run in the autocast dtype where autocast is on (as ``lm_head`` would), the softmax in
float32; the gradients are those of ``log_softmax(logit_map(hidden @ W.T) / temperature)`` at the
targets, and of the entropy where it is asked for with its gradient. ``logit_map`` is what the model
does to ``lm_head``'s output before its softmax (:class:`LogitMap`: Gemma 2 caps its logits,
Granite and Cohere scale them), and :func:`head_mismatch` checks on the loaded weights that the
chunks compute the model's own logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

#: tokens whose logits exist at once (1,024 x 151,936: 0.3 GB in bf16, and 0.6 GB for the float32
#: probabilities)
LOGIT_CHUNK_TOKENS = 1024


class LogitMap(NamedTuple):
    """What a causal LM does to its ``lm_head``'s output before the softmax, as its config says:
    multiply by ``scale`` (Cohere's ``logit_scale``; Granite divides by ``logits_scaling``), then cap
    softly at ``softcap``: ``softcap * tanh(z / softcap)`` (Gemma 2's ``final_logit_softcapping``).
    The Llama / Qwen layout does neither. Applied in float32, and differentiated through its output
    (``d/dz softcap tanh(z / softcap) = 1 - (capped / softcap)^2``)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> LogitMap:
        """From a ``transformers`` config (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = getattr(text, "logit_scale", None)
        scaling = getattr(text, "logits_scaling", None)
        softcap = getattr(text, "final_logit_softcapping", None) or getattr(text, "logits_soft_cap", None)
        return cls(
            scale=(1.0 if scale is None else float(scale)) / (1.0 if scaling is None else float(scaling)),
            softcap=None if softcap is None else float(softcap),
        )

    @classmethod
    def from_dir(cls, model_path: str | Path) -> LogitMap:
        """From ``model_path/config.json`` (its text config for a multimodal one) without loading
        anything; the identity without one."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        return cls.of(SimpleNamespace(**config.get("text_config", config)))

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` mapped, in float32; ``z`` itself where the map is the identity."""
        if self.identity:
            return z
        z = z.float() * self.scale
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap

    def derivative(self, mapped: torch.Tensor) -> torch.Tensor | float:
        """``d map(z) / dz`` from the mapped values."""
        if self.softcap is None:
            return self.scale
        return (1.0 - (mapped / self.softcap).square()) * self.scale


def head_mismatch(model: torch.nn.Module, logit_map: LogitMap, tokens: int = 8) -> str | None:
    """Why :func:`chunked_logprobs` would not compute ``model``'s own logits, or ``None``: on a probe
    of ``tokens`` tokens, ``logit_map(lm_head(last hidden state))`` against the model's logits,
    within a few roundings of the model's dtype. A model that transforms its logits in a way its
    config does not say (or whose last hidden state is not the head's input) fails it."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"{type(model).__name__}'s output embeddings are a {type(head).__name__}, not an nn.Linear"
    training = model.training
    model.eval()  # no dropout, no random numbers drawn
    try:
        with torch.no_grad():
            ids = torch.arange(tokens, device=head.weight.device)[None] % head.weight.shape[0]
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            theirs = out.logits.float()
            mine = logit_map(_logits(out.hidden_states[-1], head.weight, head.bias)).float()
    finally:
        model.train(training)
    error, size = (mine - theirs).abs().max().item(), max(1.0, theirs.abs().max().item())
    if error <= 4 * torch.finfo(out.logits.dtype).eps * size:
        return None
    return (
        f"{type(model).__name__}'s logits are not {logit_map} of its lm_head's output "
        f"(they differ by up to {error:.3g} on a probe, the logits' largest being {size:.3g})"
    )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's where it is on for the tensors' device, else the weight's."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, targets [N])`` -> log-prob of each target
    and the entropy of each token's distribution under ``softmax((hidden @ W.T + b) / temperature)``;
    ``compiled``: each chunk's math under ``torch.compile`` (see :func:`chunked_logprobs`)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, logit_map, temperature, chunk, dtype, with_entropy, compiled
    ):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(logp)
        forward_chunk, _ = _chunk_functions(compiled)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, dtype)  # once, not per chunk (float32 master weights: a bf16 copy)
            for s in range(0, hidden.shape[0], chunk):
                rows = slice(s, s + chunk)
                lp, ent = forward_chunk(
                    hidden[rows], w, b, targets[rows], logit_map, temperature, with_entropy
                )
                logp[rows] = lp
                if with_entropy:
                    entropy[rows] = ent
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.logit_map, ctx.temperature, ctx.chunk, ctx.dtype = logit_map, temperature, chunk, dtype
        ctx.compiled = compiled
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient: skip its terms
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        _, logit_grad = _chunk_functions(ctx.compiled)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, ctx.dtype)
            for s in range(0, hidden.shape[0], ctx.chunk):
                rows = slice(s, s + ctx.chunk)
                h = hidden[rows]
                g = logit_grad(
                    h,
                    w,
                    b,
                    targets[rows],
                    grad_logp[rows],
                    None if grad_entropy is None else grad_entropy[rows],
                    ctx.logit_map,
                    ctx.temperature,
                )
                if grad_hidden is not None:
                    grad_hidden[rows] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.add_(g.T @ h.to(ctx.dtype))  # accumulates in float32
                if grad_bias is not None:
                    grad_bias += g.sum(0, dtype=torch.float32)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def forward_chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    targets: torch.Tensor,
    logit_map: LogitMap,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's log-probs at ``targets`` and (``with_entropy``) entropies, float32."""
    log_probs = _log_softmax(logit_map(_logits(h, w, b)), temperature)
    logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -_rowwise_dot(log_probs.exp(), log_probs) if with_entropy else None


def logit_grad(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logit_map: LogitMap,
    temperature: float,
) -> torch.Tensor:
    """The gradient of the loss with respect to a chunk's logits, in ``w``'s dtype (the matmuls'):
    ``d logp_t / dz = (onehot(t) - p) / T`` and ``d H / dz = -p (log p + H) / T``, so it is ``p``
    times a scale (per row, or per entry with the entropy's gradient) plus ``grad_logp / T`` at
    the target, whose entry is computed in float32 and rounded once; times the logit map's
    derivative (in float32) where the model maps its logits, taken before the softmaxes may divide
    the mapped logits by the temperature in place."""
    t, z = temperature, logit_map(_logits(h, w, b))
    dz = None if logit_map.identity else logit_map.derivative(z)
    if grad_entropy is None:
        probs = torch.softmax(_over_temperature(z, t), -1, dtype=torch.float32)
        scale = grad_logp[:, None] / -t
    else:
        log_probs = _log_softmax(z, t)
        probs = log_probs.exp()
        ent = -_rowwise_dot(probs, log_probs)[:, None]
        scale = log_probs.add_(ent).mul_(grad_entropy[:, None] / -t)
        scale.sub_(grad_logp[:, None] / t)
    idx = targets[:, None]
    scale_t = scale.gather(-1, idx) if scale.shape[-1] > 1 else scale
    at_target = probs.gather(-1, idx) * scale_t + grad_logp[:, None] / t
    if dz is not None:
        return (probs * scale).scatter_(-1, idx, at_target).mul_(dz).to(w.dtype)
    if torch.compiler.is_compiling():  # Inductor fuses the product and its cast
        g = (probs * scale).to(w.dtype)
    else:  # eager: the product written once, in the matmul's dtype
        g = torch.mul(probs, scale, out=probs.new_empty(probs.shape, dtype=w.dtype))
    return g.scatter_(-1, idx, at_target.to(g.dtype))


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def _chunk_functions(compiled: bool):
    """``(forward_chunk, logit_grad)``, eager or compiled once per process: a micro-batch's chunks
    are ``chunk`` rows but its last, so the first shape compiles static and the second once more
    with the rows dynamic (torch's automatic dynamic shapes), whatever the sizes after."""
    if not compiled:
        return forward_chunk, logit_grad
    return _compiled(forward_chunk), _compiled(logit_grad)


def _cast(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits in ``weight``'s dtype, as ``lm_head`` computes them under autocast."""
    hidden = hidden.to(weight.dtype)
    return hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)


def _over_temperature(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z / temperature`` in float32 (in place where ``z`` is float32 already); ``z`` itself at
    temperature 1 (the softmaxes read it in its own dtype then, with no divided copy written)."""
    return z if temperature == 1.0 else z.float().div_(temperature)


def _log_softmax(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 log-softmax of ``z / temperature``."""
    return torch.log_softmax(_over_temperature(z, temperature), -1, dtype=torch.float32)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)``; in eager as one batched product (each input read once, no product
    tensor written), compiled as written (Inductor fuses it into one reduction)."""
    if torch.compiler.is_compiling():
        return (a * b).sum(-1)
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    chunk: int = LOGIT_CHUNK_TOKENS,
    entropy: bool = True,
    compiled: bool = False,
    logit_map: LogitMap | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` ``[B, R]`` after ``hidden`` ``[B, R, H]`` through ``head`` (then
    ``logit_map``: the identity unless given), and each position's entropy (differentiable; detach
    it for the log; ``None`` unless ``entropy``), both ``[B, R]`` float32. ``compiled``: each
    chunk's softmax, gather, entropy and logit gradient under ``torch.compile``
    (``trainer.compile``), which fuses their passes over the logits into one or two reads of them
    (the head's matmuls stay cuBLAS's)."""
    b, r, _ = hidden.shape
    logp, ent = ChunkedHeadLogprobs.apply(
        hidden.reshape(b * r, -1),
        head.weight,
        head.bias,
        targets.reshape(-1),
        LogitMap() if logit_map is None else logit_map,
        temperature,
        chunk,
        _compute_dtype(hidden, head.weight),
        entropy,
        compiled,
    )
    return logp.view(b, r), ent.view(b, r) if entropy else None
