"""The CPU allocator's thresholds in a worker's process: glibc's malloc with fixed mmap and trim
thresholds, so the tensors of each step reuse memory instead of faulting it in again.

glibc serves a block above its mmap threshold (128 KiB at start) with ``mmap`` and unmaps it on
free, and trims the top of its heap back to the system once more than its trim threshold is free;
both thresholds adapt to the largest block freed so far. A training step allocates and frees the
same large activations and gradients every micro-batch, so whatever falls past the thresholds is
mapped, faulted in page by page and handed back each time, and how far they adapted depends on the
sizes the process happened to see first (auto's profiling at small micro-batches left them where
a run that started large did not). Fixed at 32 MiB (mmap) and 256 MiB (trim), freed blocks stay
for the next step: what jemalloc or tcmalloc, preloaded, give PyTorch on CPU, without a preload.

Set in the driver by the in-process runtime and in every worker process at its start (the
launchers call :func:`tune_malloc`). Left alone where the process is not on glibc, where the user
set glibc's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``, or with
``RLINF_MALLOC_TUNING=0``. An fsdp rank lowers the mmap threshold again for its own process
(:func:`set_mmap_threshold`, ``engines.distributed``): its per-layer collective buffers would
otherwise fragment the heap.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest dynamic mmap threshold on 64-bit
TRIM_THRESHOLD = 256 * 2**20
OPT_OUT = "RLINF_MALLOC_TUNING"
USER_SET = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _mallopt() -> Any:
    """glibc's ``mallopt``, or ``None`` where the C library is another."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def tune_malloc() -> bool:
    """Fix this process's glibc mmap and trim thresholds (see the module docstring); returns whether
    they were set."""
    if os.environ.get(OPT_OUT) == "0" or any(k in os.environ for k in USER_SET):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def set_mmap_threshold(threshold_mb: float) -> None:
    """Fix glibc's mmap threshold for this process at ``threshold_mb`` MiB (an fsdp rank's setting).

    Raises where the C library is not glibc, since the setting would silently do nothing there.
    """
    mallopt = _mallopt()
    if mallopt is None:
        raise RuntimeError(
            f"malloc_mmap_threshold_mb={threshold_mb} needs glibc, which this process does not use: "
            "set malloc_mmap_threshold_mb=None"
        )
    if mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)) != 1:
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {threshold_mb} MiB) was refused (the limit is 32 MiB)")
