"""Model FLOPs utilisation: the model FLOPs a train step needed over what the device could do in
that time, with the device's peak *measured* here (a large matmul in the training dtype) rather
than read from a datasheet, so the figure is honest on any CPU or GPU.

Model FLOPs count useful work only (PaLM's definition, appendix B): ``6 N`` per trained token for
the matmul parameters ``N`` (forward 2N, backward 4N) plus causal attention, ``6 L d`` per token
per earlier token. Padding, recomputation and optimizer work are not counted, so they lower MFU.
A policy counts its own (``RLModule.train_flops``; ``policies.lm.causal_lm_train_flops``).
"""

from __future__ import annotations

import time
from functools import cache

import torch

CPU_MIN_RUN_S = 0.002  # a CPU product this long reaches the peak; smaller ones are grown
CPU_WIDTHS = (512, 768, 1024, 2048, 4096)  # the square products tried, smallest first


@cache
def peak_matmul_flops(device: str, dtype: torch.dtype, threads: int) -> float:
    """Best FLOP/s of a square matmul in ``dtype`` on ``device`` (``threads``: the torch intra-op
    threads it ran with, part of the cache key because the peak scales with them).

    On a GPU the product is 8192 wide and timed with CUDA events over ten back-to-back runs after
    warm-ups: a narrower one timed alone on the host clock, where launch and clock ramp-up
    dominate a short kernel, reads a GPU well under its peak, which overstated MFU.
    On CPU it is the smallest of ``CPU_WIDTHS`` whose run takes ``CPU_MIN_RUN_S``
    (:func:`cpu_matmul_peak`): a narrow float32 matmul already reaches the wide ones' rate, in a
    fraction of their time (paid again at each thread count), while bf16 (AMX) needs a wider one
    (the widths measured: docs/benchmarks.md)."""
    if device.startswith("cuda"):
        return _cuda_peak(device, dtype)
    return cpu_matmul_peak(dtype)[1]


def cpu_matmul_peak(dtype: torch.dtype) -> tuple[int, float]:
    """``(width, FLOP/s)``: the best of three timed runs (after a warm-up: kernel selection, page
    faults) of the smallest square product of ``CPU_WIDTHS`` whose best run takes
    ``CPU_MIN_RUN_S`` (else the widest), in ``dtype`` with torch's current threads."""
    gen = torch.Generator().manual_seed(0)  # not the run's stream: measuring must not move its samples
    for n in CPU_WIDTHS:
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        a @ b
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        if best >= CPU_MIN_RUN_S:
            break
    return n, 2.0 * n**3 / best


def _cuda_peak(device: str, dtype: torch.dtype, n: int = 8192, runs: int = 10) -> float:
    gen = torch.Generator(device).manual_seed(0)  # not the run's stream
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        a @ b
    end.record()
    end.synchronize()
    return 2.0 * n**3 * runs / (start.elapsed_time(end) / 1e3)
