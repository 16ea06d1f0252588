"""How sampling's random streams derive from ``trainer.seed``.

Each stream is a pure function of the seed and of *what* is drawn (a prompt group, a sample, an
iteration), never of how the work was split, so every execution plan draws the same numbers. The
strides are primes larger than any count they are added to, so two different inputs never give the
same seed. (The other fixed seeds live with their one user: ``tasks.math.EPOCH_SEED_STRIDE`` for
the data order, ``workflows.embodied.EVAL_SEED`` for evaluation episodes.)
"""

from __future__ import annotations

SEED_STRIDE = 1_000_003  # > prompt groups (or env groups) per iteration: seed*stride + group is unique
SAMPLE_STRIDE = 1_000_033  # > samples per group: (seed*stride + group)*stride + sample is unique
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive integers over 64 bits


def row_seed(seed: int, group: int, sample: int) -> int:
    """A deterministic 63-bit seed for sample ``sample`` of prompt group ``group`` (Fibonacci
    hashing, so nearby rows get unrelated generators)."""
    x = (seed * SEED_STRIDE + group) * SAMPLE_STRIDE + sample
    return (x * _GOLDEN) & 0x7FFF_FFFF_FFFF_FFFF
