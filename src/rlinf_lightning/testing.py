"""Fixture builders for tests and benchmarks: everything they train from, built in one place so
they all start alike (the library itself never imports this module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.sft import run_sft
from rlinf_lightning.tasks.data import make_arithmetic_splits


def build_warm_started(
    root: str | Path, *, n_train: int = 2000, n_test: int = 64, **sft: Any
) -> dict[str, Path]:
    """Under ``root``: a tiny Qwen2, arithmetic train/test splits, and that model after SFT on them.

    What tests and benchmarks train from, built in one place so they all start alike. ``sft``
    goes to :func:`~rlinf_lightning.sft.run_sft` (default: 60 steps of 32, eval on 64).
    Returns ``{"base", "sft", "train", "test", "root"}``.
    """
    root = Path(root)
    base = build_tiny_qwen2(root / "tiny-qwen2")
    train, test = make_arithmetic_splits(root / "data", n_train=n_train, n_test=n_test)
    out = root / "tiny-qwen2-sft"
    run_sft(
        str(base), str(train), str(test), str(out), **{"steps": 60, "batch_size": 32, "eval_size": 64, **sft}
    )
    return {"base": base, "sft": out, "train": train, "test": test, "root": root}
