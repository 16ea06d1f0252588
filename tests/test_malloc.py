"""The CPU allocator's thresholds (``rlinf_lightning.malloc``): a step's freed tensors are reused, not
faulted in again; glibc's own settings and the opt-out are respected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FAULTS = """
import ctypes, json, resource, sys, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count faults in 4 KiB pages on any host
from rlinf_lightning.malloc import M_MMAP_THRESHOLD, tune_malloc
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's start, fixed: blocks are mapped
tuned = tune_malloc()
def step():  # activations of a few sizes, freed together, as a training step's are
    ts = [torch.empty(2**20 * mib // 4).fill_(1.0) for mib in (1, 3, 6, 12, 24, 2, 5)]
    del ts
for _ in range(3):
    step()
per_step = []
for _ in range(21):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    per_step.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": sorted(per_step)[10]}))  # the median step
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _faults(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RLINF_MALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", FAULTS], env={**environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_tensors_are_reused_instead_of_faulted_in_again():
    """Each process starts from glibc's starting mmap threshold (128 KiB) fixed, so every block of
    the step is mapped on allocation and unmapped on free: 13 575 page faults a step untuned, none
    once :func:`tune_malloc` has replaced the thresholds. The adaptive thresholds glibc starts with
    are no baseline: which steps they fault on depends on the machine (12 512 a step in most runs on
    one box, 51 in the others; none on a 2026-12-07 AMD EPYC, where this test failed). The median
    step is counted, not the mean: CI once saw a mean of 141 a step over 20 steps with the thresholds
    fixed (2 816 faults in all; whether in one step or spread out, and why, was not recorded)."""
    tuned, opted_out = _faults(), _faults(RLINF_MALLOC_TUNING="0")
    assert tuned["tuned"] and not opted_out["tuned"]
    assert tuned["faults"] < 1 < opted_out["faults"] / 10, (tuned, opted_out)


def test_glibc_settings_of_the_user_win():
    assert not _faults(MALLOC_TRIM_THRESHOLD_="131072")["tuned"]
