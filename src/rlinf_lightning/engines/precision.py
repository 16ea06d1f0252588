"""Training precision, with Lightning's names.

* ``32-true``: float32 weights, optimizer state and compute.
* ``bf16-mixed``: float32 master weights and optimizer state; the forward and backward run under
  bfloat16 autocast (matmuls in bf16, reductions and softmax in float32). The policy returns
  float32 log-probs, so ratios, advantages and losses stay float32.
* ``bf16-true``: weights, gradients and optimizer state in bfloat16 (half the memory, least exact).
* ``auto``: ``bf16-mixed`` where the device computes bf16 natively (a CUDA GPU with bf16, or a CPU
  with AVX512-BF16 or AMX), else ``32-true``; the resolved name is what the run reports.

The rollout engine's dtype follows the resolved precision by default (``resolve_rollout_dtype``).
"""

from __future__ import annotations

import contextlib
from functools import cache

import torch

from rlinf_lightning.policies.module import DTYPES

PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true")


@cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it PyTorch
    emulates bf16 and mixed precision is slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def resolve_precision(precision: str, device: str) -> str:
    """``precision`` with ``auto`` decided for ``device`` (``cpu``, ``cuda:i``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cpu_has_native_bf16() else "32-true"


#: ``task.rollout_dtype``'s default: the rollout follows the actor's precision
AUTO_ROLLOUT_DTYPE = "auto"


def rollout_dtype_problem(setting: str | None) -> str | None:
    """Why ``task.rollout_dtype`` is not a setting :func:`resolve_rollout_dtype` takes, or ``None``."""
    if setting in (AUTO_ROLLOUT_DTYPE, None, *DTYPES):
        return None
    return f"must be auto, float32, bfloat16, float16 or null, got {setting!r}"


def resolve_rollout_dtype(setting: str | None, precision: str, device: str, policy_dtype: str) -> str:
    """The rollout engine's dtype for ``task.rollout_dtype``: ``auto`` is ``bfloat16`` where the
    actor trains in a bf16 precision (``precision`` resolved for ``device``: the actor computes in
    bf16 anyway, and a bf16 rollout generates faster on a CPU with native bf16: docs/benchmarks.md),
    else the policy's dtype; ``None`` is the policy's dtype; a dtype name is itself."""
    if setting == AUTO_ROLLOUT_DTYPE:
        return "bfloat16" if resolve_precision(precision, device).startswith("bf16") else policy_dtype
    return setting or policy_dtype


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    """The autocast context a forward/backward runs in under ``precision`` (resolved)."""
    if precision == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype the weights are cast to (``None``: leave them as loaded)."""
    return torch.bfloat16 if precision == "bf16-true" else None
