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
float32; the gradients are those of ``log_softmax(hidden @ W.T / temperature)`` at the targets,
and of the entropy where it is asked for with its gradient.
"""

from __future__ import annotations

import torch

#: tokens whose logits exist at once (1,024 x 151,936: 0.3 GB in bf16, and 0.6 GB for the float32
#: probabilities)
LOGIT_CHUNK_TOKENS = 1024


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's where it is on for the tensors' device, else the weight's."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, targets [N])`` -> log-prob of each target
    and the entropy of each token's distribution under ``softmax((hidden @ W.T + b) / temperature)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, dtype, with_entropy):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, dtype)  # once, not per chunk (float32 master weights: a bf16 copy)
            for s in range(0, hidden.shape[0], chunk):
                log_probs = _log_softmax(_logits(hidden[s : s + chunk], w, b), temperature)
                logp[s : s + chunk] = log_probs.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
                if with_entropy:
                    entropy[s : s + chunk] = -_rowwise_dot(log_probs.exp(), log_probs)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient: skip its terms
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        n, t = hidden.shape[0], ctx.temperature
        if grad_logp is None:
            grad_logp = hidden.new_zeros(n, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, ctx.dtype)
            for s in range(0, n, ctx.chunk):
                h, rows = hidden[s : s + ctx.chunk], slice(s, s + ctx.chunk)
                z = _logits(h, w, b)
                # d logp_t / dz = (onehot(t) - p) / T;  d H / dz = -p (log p + H) / T
                if grad_entropy is None:
                    probs = torch.softmax(z if t == 1.0 else z.float().div_(t), -1, dtype=torch.float32)
                    scale = grad_logp[rows, None] / -t
                else:
                    log_probs = _log_softmax(z, t)
                    probs = log_probs.exp()
                    ent = -_rowwise_dot(probs, log_probs)[:, None]
                    scale = log_probs.add_(ent).mul_(grad_entropy[rows, None] / -t)
                    scale.sub_(grad_logp[rows, None] / t)
                idx = targets[rows, None]
                # the target's entry, p_t * scale_t + grad / T, rounded once to the matmul's dtype
                scale_t = scale.gather(-1, idx) if scale.shape[-1] > 1 else scale
                at_target = probs.gather(-1, idx) * scale_t + grad_logp[rows, None] / t
                g = torch.mul(probs, scale, out=probs.new_empty(probs.shape, dtype=ctx.dtype))
                g.scatter_(-1, idx, at_target.to(g.dtype))
                if grad_hidden is not None:
                    grad_hidden[rows] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.add_(g.T @ h.to(ctx.dtype))  # accumulates in float32
                if grad_bias is not None:
                    grad_bias += g.sum(0, dtype=torch.float32)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _cast(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits in ``weight``'s dtype, as ``lm_head`` computes them under autocast."""
    hidden = hidden.to(weight.dtype)
    return hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)


def _log_softmax(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 log-softmax of ``z / temperature``, reading ``z`` in its own dtype at temperature 1."""
    if temperature != 1.0:
        z = z.float().div_(temperature)
    return torch.log_softmax(z, -1, dtype=torch.float32)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` as one batched product: each input read once, no product tensor written."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    chunk: int = LOGIT_CHUNK_TOKENS,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` ``[B, R]`` after ``hidden`` ``[B, R, H]`` through ``head``, and each
    position's entropy (differentiable; detach it for the log; ``None`` unless ``entropy``), both
    ``[B, R]`` float32."""
    b, r, _ = hidden.shape
    logp, ent = ChunkedHeadLogprobs.apply(
        hidden.reshape(b * r, -1),
        head.weight,
        head.bias,
        targets.reshape(-1),
        temperature,
        chunk,
        _compute_dtype(hidden, head.weight),
        entropy,
    )
    return logp.view(b, r), ent.view(b, r) if entropy else None
