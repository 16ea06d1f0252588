"""Response log-probs and entropy through the lm head a chunk of tokens at a time.

The whole micro-batch's logits (tokens x vocabulary: 16,384 x 151,936 is 5 GB in bf16, 10 GB as the
float32 log-softmax autograd keeps) never exist: the forward computes each chunk's logits, keeps
only each token's log-sum-exp, and the backward recomputes the chunk's logits to form their
gradient, which goes straight into the hidden states' and the head's gradients. Activation memory
per token no longer scales with the vocabulary; the price is one more head matmul per chunk in the
backward (2 x hidden x vocabulary FLOPs a token, a few percent of a small model's step).

The matmuls run in the autocast dtype where autocast is on (as ``lm_head`` would), the softmax in
float32; the gradients are those of ``log_softmax(hidden @ W.T / temperature)`` at the targets,
and of the entropy where it is asked for with its gradient.
"""

from __future__ import annotations

import torch

#: tokens whose logits exist at once (float32: 1,024 x 151,936 x 4 bytes = 0.6 GB, twice over)
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
        lse = torch.empty_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # once, not per chunk (float32 master weights: a bf16 copy)
            for s in range(0, hidden.shape[0], chunk):
                z = _logits(hidden[s : s + chunk], w, bias, temperature)
                lse[s : s + chunk] = torch.logsumexp(z, -1)
                logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
                if with_entropy:
                    log_probs = z.sub_(lse[s : s + chunk, None])
                    entropy[s : s + chunk] = -(log_probs.exp() * log_probs).sum(-1)
        logp -= lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient: skip its terms
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk]
                z = _logits(h, w, bias, ctx.temperature)
                log_probs = z.sub_(lse[s : s + ctx.chunk, None])
                probs = log_probs.exp()
                # d logp_t / dz = onehot(t) - p;  d H / dz = -p (log p + H)
                g = probs * -grad_logp[s : s + ctx.chunk, None]
                if grad_entropy is not None:
                    ent = -(probs * log_probs).sum(-1, keepdim=True)
                    g -= grad_entropy[s : s + ctx.chunk, None] * probs * (log_probs + ent)
                g.scatter_add_(-1, targets[s : s + ctx.chunk, None], grad_logp[s : s + ctx.chunk, None])
                g /= ctx.temperature
                gd = g.to(ctx.dtype)
                if grad_hidden is not None:
                    grad_hidden[s : s + ctx.chunk] = (gd @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (gd.T @ h.to(ctx.dtype)).float()
                if grad_bias is not None:
                    grad_bias += g.sum(0)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """A chunk's float32 logits over the temperature, the matmul in ``weight``'s dtype (a fresh
    tensor: callers modify it in place)."""
    z = (hidden.to(weight.dtype) @ weight.T).float()
    if bias is not None:
        z += bias.float()
    return z.div_(temperature) if temperature != 1.0 else z


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
