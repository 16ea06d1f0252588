"""Where a ``transformers`` decoder's eager math costs a mixed-precision training step more than it
must, and the same math with fewer passes over memory.

Under ``bf16-mixed`` the weights are float32 masters, so the residual stream, the RMSNorms and (as
``transformers`` writes it) the rotary embedding run in float32 between the bf16 matmuls. Each
element-wise op is a kernel that reads and writes whole activations: on a GPU the step's
element-wise traffic is as long as its matmuls (``benchmarks/actor_bound.py``). What changes here
keeps what is computed up to rounding (the norms': float32's; the rotation's: bf16's, to which
autocast rounded its result anyway), and where it cannot, the module is left alone.
:func:`adapt_for_training` applies both to a freshly loaded model.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.utils._python_dispatch import _disable_current_modes


def adapt_for_training(model: torch.nn.Module) -> None:
    """:func:`rotate_in_autocast_dtype` and :func:`fuse_rms_norms` on ``model``'s modules."""
    rotate_in_autocast_dtype(model)
    fuse_rms_norms(model)


def rotate_in_autocast_dtype(model: torch.nn.Module) -> None:
    """Under autocast, each rotary embedding's cos and sin in the autocast dtype. ``transformers``
    casts them to the hidden states' dtype, which float32 master weights make float32 under
    ``bf16-mixed``, so the query and key rotation, the repeated key/value heads and their backward
    ran in float32, and autocast then cast the rotated query and key to bf16 for attention: the
    float32 work was rounded away. In bf16 they rotate as a bf16 model (the rollout engine's)
    rotates them. Computed on fake tensors for the Qwen2.5-0.5B step on an H200
    (``benchmarks/actor_bound.py``): 29 ms off the eager step's 656 ms floor. Outside autocast
    (float32, or bf16 weights) nothing changes."""

    def cast(module: torch.nn.Module, args: tuple, out: object) -> object:
        if not isinstance(out, tuple) or not out or not isinstance(out[0], torch.Tensor):
            return None
        kind = out[0].device.type
        if not torch.is_autocast_enabled(kind):
            return None
        dtype = torch.get_autocast_dtype(kind)
        return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in out)

    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.register_forward_hook(cast)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Each RMSNorm that computes ``weight * x / rms(x)`` (the Llama / Qwen layout: checked on a
    probe, see :func:`computes_rms_norm`) runs through ``torch.nn.functional.rms_norm`` when its
    input and weight are float32 (the residual stream over float32 master weights); returns how
    many. ``transformers`` writes the norm as five element-wise ops, whose autograd keeps the
    normalised output too and runs about ten in the backward; on CUDA, ``rms_norm`` is one fused
    kernel forward and fused ones backward (torch >= 2.9: aten's two, for the input's and the
    weight's gradients), and keeps only the input and one scale a row.
    On a CPU ``rms_norm`` is those same five ops, with equal results to the bit. Another dtype
    (bf16 weights: the rollout engine's, FSDP2's mixed precision) keeps the module's own math:
    ``transformers`` rounds the normalised input to bf16 before the weight multiplies it, the fused
    kernel once after, and log-probs compared across engines must round alike."""
    count = 0
    for module in model.modules():
        if computes_rms_norm(module):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


def computes_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm (by name, with a 1-D ``weight`` and a ``variance_epsilon``)
    whose own forward equals ``rms_norm`` with its weight and epsilon in float32 on a probe: a
    variant that offsets its weight (Gemma's ``1 + weight``) or reads other attributes fails it."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float):
        return False
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return False
    return _forward_is_rms_norm(type(module), eps)


@functools.cache
def _forward_is_rms_norm(cls: type, eps: float) -> bool:
    """The class's forward on a stand-in instance (a random weight and ``eps``, nothing else), on
    real CPU tensors even where the model is built on fake or meta ones."""
    with _disable_current_modes(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        probe = cls.__new__(cls)
        torch.nn.Module.__init__(probe)
        probe.weight = torch.nn.Parameter(torch.randn(16, generator=gen, device="cpu"))
        probe.variance_epsilon = eps
        x = 3 * torch.randn(3, 16, generator=gen, device="cpu")
        try:
            own = cls.forward(probe, x)
        except Exception:  # the forward needs more than a weight and an epsilon: not this layout
            return False
        fused = torch.nn.functional.rms_norm(x, (16,), probe.weight, eps)
        return isinstance(own, torch.Tensor) and own.shape == x.shape and torch.allclose(own, fused)


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if hidden_states.dtype == weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)
