"""``benchmarks/actor_bound.py``: each op's floor from its FLOPs and bytes on fake tensors, and what
it says of the chunked lm head (its passes over the logits are what a GPU's bandwidth pays for)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from actor_bound import CudaRMSNorm, OpFloor  # noqa: E402

from rlinf_lightning.kernels.chunked_head import chunked_logprobs  # noqa: E402

PEAK, BANDWIDTH = 100e12, 1e12


def test_each_op_costs_its_flops_or_its_bytes_and_views_cost_nothing():
    with FakeTensorMode():
        a, b, index = torch.empty(256, 512), torch.empty(512, 1024), torch.zeros(256, 1, dtype=torch.long)
        with OpFloor(PEAK, BANDWIDTH) as floor:
            c = a @ b  # 2 m n k FLOPs; reads a and b, writes c
            d = c + c  # reads two, writes one
            c.view(-1)  # a view: free
            c.gather(-1, index)  # the index and its 256 entries only
    matmul_bytes = (256 * 512 + 512 * 1024 + 256 * 1024) * 4
    assert floor.flops == 2 * 256 * 512 * 1024
    assert floor.moved["matmul"] == matmul_bytes
    assert floor.seconds["matmul"] == max(floor.flops / PEAK, matmul_bytes / BANDWIDTH)
    add_bytes = 3 * d.numel() * 4
    gather_bytes = 256 * 8 + 2 * 256 * 4
    assert floor.moved["other"] == add_bytes + gather_bytes
    assert floor.kernels == 3


def test_the_chunked_heads_step_moves_few_bytes_per_logit():
    """Forward (log-probs and the logged entropy) and backward of the chunked head under bf16
    autocast: the logits are written once in bf16 per pass and read by one softmax; the gradient is
    written once. Before (a float32 copy, in-place subtract, exp, multiply and sum for the entropy;
    a multiply, scatter, division and cast for the gradient) it moved 110 bytes per token and
    vocabulary entry here; now 70."""
    n, hidden, vocab = 512, 64, 4096
    with FakeTensorMode():
        h = torch.empty(n, hidden, requires_grad=True)
        head = torch.nn.Linear(hidden, vocab, bias=False)
        targets = torch.zeros(1, n, dtype=torch.long)
        with OpFloor(PEAK, BANDWIDTH) as floor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = chunked_logprobs(h[None], head, targets, 1.0, chunk=128, entropy=True)
            logp.sum().backward()
    per_logit = (floor.moved["matmul"] + floor.moved["other"]) / (n * vocab)
    assert per_logit < 90, per_logit


def test_rms_norm_costs_what_cudas_fused_kernels_move():
    """On a CPU ``rms_norm`` is five ops forward and about ten backward; the bound counts CUDA's:
    one forward kernel (the input and weight read, the output and each row's scale written) and two
    backward (the input's gradient; the weight's, which reads the gradient and input again)."""
    rows, width = 64, 32
    with FakeTensorMode():
        x = torch.empty(rows, width, requires_grad=True)
        weight = torch.nn.Parameter(torch.empty(width))
        with OpFloor(PEAK, BANDWIDTH) as floor, CudaRMSNorm():
            y = torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)
            y.backward(torch.empty_like(y))
    vector, scale, row = width * 4, rows * 4, rows * width * 4
    forward = row + vector + row + scale
    backward = (row + row + scale + vector + row) + (row + row + scale + vector)
    assert floor.kernels == 3
    assert floor.moved["other"] == forward + backward
