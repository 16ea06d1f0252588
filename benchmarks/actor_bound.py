"""The eager actor step's floor on a GPU, computed on any machine (section ``bound`` of ``gpu.py``).

Every aten op of one GRPO optimizer step (the reasoning workflow's ``PolicyLoss`` over the
micro-batches a token budget cuts, each micro-batch's backward, then the train engine's step:
gradients over the count, the norm clipped, fused AdamW) runs on fake tensors
(``FakeTensorMode``: shapes and dtypes, no data, no memory), at the model's real shape. Each op's
FLOPs (torch's flop-counter formulas) and bytes (its tensor inputs read once, its outputs and
in-place arguments written once; views, reshapes and allocations free) give the least time a
device with matmul peak ``P`` and memory bandwidth ``W`` can spend on it: ``max(flops / P,
bytes / W)``. Their sum is the step's floor, and the model FLOPs (PaLM's count, as ``actor``
reports MFU) over the floor over ``P`` is the highest MFU the eager step can reach there: kernel
launch gaps, matmuls below the peak and unfused passes that miss the bandwidth only add time.

What it stands in for: CPU autocast's op lists for CUDA's (both run matmuls and attention in bf16;
the rotary embedding casts explicitly), the CPU flash-attention kernel's I/O for the GPU's flash or
memory-efficient kernel (equal inputs and outputs), and for ``rms_norm``, which a CPU runs as five
ops, CUDA's fused kernels (:class:`CudaRMSNorm`). The micro-batch's copy to the device and the
host's work are not counted.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from pathlib import Path

import torch
from gpu_common import rollout_batch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
#: ops that move no data: reshapes the schema cannot tell from copies, and allocations
FREE = {
    aten._unsafe_view.default,
    aten.lift_fresh.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
}
#: ops that touch a tensor's entries at an index only: (position of the index, of the values moved)
INDEXED = {
    aten.gather.default: (2, None),  # None: the output
    aten.index_select.default: (2, None),
    aten.embedding.default: (1, None),
    aten.scatter_.src: (2, 3),
    aten.scatter_add_.default: (2, 3),
}
#: the CPU's fused attention, which the flop counter's formulas (written for CUDA's kernels) miss
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: 4,  # Q K^T and P V: 2 x 2 B H Tq Tk D
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 8,  # dV, dP, dQ, dK
}


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _written(func, args, kwargs, out) -> int:
    """Bytes an op writes: its fresh outputs and the arguments it modifies in place."""
    schema = func._schema
    written = 0
    named = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write and arg.name in named:
            written += _nbytes(named[arg.name])
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:
            written += _nbytes(value)
    return written


def _flops(func, args, kwargs, out) -> float:
    if func in CPU_ATTENTION:
        q, k = (args[1], args[2]) if func.__name__.endswith("backward.default") else (args[0], args[1])
        b, h, tq, d = q.shape
        return CPU_ATTENTION[func] * b * h * tq * k.shape[-2] * d
    formula = flop_registry.get(func._overloadpacket)
    return float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0


class OpFloor(TorchDispatchMode):
    """Each dispatched op's least time on a device of ``peak`` FLOP/s and ``bandwidth`` bytes/s."""

    def __init__(self, peak: float, bandwidth: float) -> None:
        super().__init__()
        self.peak, self.bandwidth = peak, bandwidth
        self.kernels, self.flops = 0, 0.0
        self.seconds = {"matmul": 0.0, "other": 0.0}
        self.moved = {"matmul": 0, "other": 0}
        self.by_op: Counter = Counter()  # bytes of the other ops per (op, dtype): where their time goes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if func.namespace == "prim" or func in FREE or view:
            return out
        if func in INDEXED:  # the index, and the entries read and written
            index, values = INDEXED[func]
            moved = _nbytes(args[index]) + 2 * _nbytes(out if values is None else args[values])
        else:
            read = {k: v for k, v in kwargs.items() if k != "out"}  # an out= tensor is written, not read
            moved = _nbytes((args, read)) + _written(func, args, kwargs, out)
        flops = _flops(func, args, kwargs, out)
        kind = "matmul" if flops else "other"
        self.kernels += 1
        self.flops += flops
        self.moved[kind] += moved
        self.seconds[kind] += max(flops / self.peak, moved / self.bandwidth)
        if kind == "other":
            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            dtype = str(getattr(first, "dtype", "")).removeprefix("torch.")
            self.by_op[f"{func.__name__.removesuffix('.default')} {dtype}"] += moved
        return out


@torch.library.custom_op("rlinf_bound::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's fused forward (aten ``_fused_rms_norm``): the output and each row's scale."""
    raise NotImplementedError("an op for fake tensors: its cost is what the bound needs")


@torch.library.custom_op("rlinf_bound::rms_norm_grad_input", mutates_args=())
def _rms_norm_grad_input(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """CUDA's backward kernel for the input's gradient."""
    raise NotImplementedError("an op for fake tensors: its cost is what the bound needs")


@torch.library.custom_op("rlinf_bound::rms_norm_grad_weight", mutates_args=())
def _rms_norm_grad_weight(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """CUDA's second backward kernel, the weight's gradient (it reads the gradient and input again)."""
    raise NotImplementedError("an op for fake tensors: its cost is what the bound needs")


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], 1)


@_rms_norm_grad_input.register_fake
def _(grad, x, rstd, weight):
    return torch.empty_like(x)


@_rms_norm_grad_weight.register_fake
def _(grad, x, rstd):
    return x.new_empty(x.shape[-1])


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # the scale gets no gradient: no zeros written for it


def _rms_norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    return _rms_norm_grad_input(grad, x, rstd, weight), _rms_norm_grad_weight(grad, x, rstd), None


_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


class CudaRMSNorm(TorchFunctionMode):
    """``torch.nn.functional.rms_norm`` (``kernels.fused_decoder``'s fused norms) as CUDA runs it: one
    kernel forward, two backward, each reading its inputs once."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.rms_norm:
            call = inspect.signature(func).bind(*args, **kwargs)
            x, weight, eps = (call.arguments.get(k) for k in ("input", "weight", "eps"))
            if weight is not None and eps is not None:
                return _rms_norm(x, weight, eps)[0]
        return func(*args, **kwargs)


def step_floor(model: Path, micro_batches: list, peak: float, bandwidth: float) -> OpFloor:
    """One GRPO step of the library's loss over ``micro_batches`` on fake tensors, timed by
    :class:`OpFloor` (the engine's own ``accumulate``/``step`` read losses and norms on the host,
    which fake tensors have no values for, so their tensor work is repeated here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.train import split_optimizers
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.workflows.reasoning.actor import PolicyLoss

    with FakeTensorMode(allow_non_fake_inputs=True):
        policy = LMPolicy(str(model), lr=1e-6)
        policy.meta_model()  # from config.json: fake weights, no file read
        policy.model.train()
        # a GPU's attention kernel: on a CPU a bf16 training forward takes the math kernel instead
        policy.training_attention = lambda ids: contextlib.nullcontext()
        optimizer, _ = split_optimizers(policy.configure_optimizers())
        loss = PolicyLoss(GRPO(), temperature=1.0)
        floor = OpFloor(peak, bandwidth)
        with floor, CudaRMSNorm():
            count = 0
            for mb in micro_batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed
                    loss_sum, n, _ = loss(policy, mb)
                loss_sum.backward()
                count = count + n
            params = [p for p in policy.model.parameters() if p.grad is not None]
            for p in params:
                p.grad.div_(count)
            torch.nn.utils.clip_grad_norm_(params, policy.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return floor


def bench_bound(model: Path, args) -> dict:
    """Per token budget: kernels, TFLOPs and GB dispatched, the floor on a device of
    ``--bound-tflops`` and ``--bound-tbs``, and the MFU ceiling; the largest movers at the first."""
    from gpu_common import load_meta

    from rlinf_lightning.policies.lm import causal_lm_train_flops
    from rlinf_lightning.workflows.padding import micro_batches

    peak, bandwidth = args.bound_tflops * 1e12, args.bound_tbs * 1e12
    batch = rollout_batch(args.sequences, args.token_vocab, args.new_tokens)
    model_flops = causal_lm_train_flops(load_meta(model), batch["attention_mask"])
    out: dict = {
        "peak_tflops": args.bound_tflops,
        "bandwidth_tbs": args.bound_tbs,
        "model_tflops_per_step": round(model_flops / 1e12, 2),
        "budgets": {},
    }
    for i, budget in enumerate(args.max_tokens):
        t0 = time.perf_counter()
        chunks = micro_batches(batch, None, budget)
        floor = step_floor(model, chunks, peak, bandwidth)
        seconds = sum(floor.seconds.values())
        row = {
            "micro_batches": len(chunks),
            "kernels": floor.kernels,
            "dispatched_tflops": round(floor.flops / 1e12, 2),
            "matmul_gb": round(floor.moved["matmul"] / 1e9, 2),
            "other_gb": round(floor.moved["other"] / 1e9, 2),
            "floor_matmul_ms": round(floor.seconds["matmul"] * 1e3, 2),
            "floor_other_ms": round(floor.seconds["other"] * 1e3, 2),
            "floor_ms": round(seconds * 1e3, 2),
            "mfu_ceiling": round(model_flops / seconds / peak, 3),
        }
        if i == 0:
            row["top_other_gb"] = {k: round(v / 1e9, 2) for k, v in floor.by_op.most_common(10)}
        out["budgets"][budget] = row
        print(f"bound  budget {budget} ({time.perf_counter() - t0:.0f} s): {row}", flush=True)
    best = max(out["budgets"], key=lambda b: out["budgets"][b]["mfu_ceiling"])
    out.update(best_budget=best, mfu_ceiling=out["budgets"][best]["mfu_ceiling"])
    return out
