"""Tiny assets for the plugin's tests, built locally (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    from rlinf_lightning.assets import build_tiny_qwen2
    from rlinf_lightning.sft import run_sft
    from rlinf_lightning.tasks.data import make_arithmetic_splits

    root = tmp_path_factory.mktemp("vllm-assets")
    base = build_tiny_qwen2(root / "tiny-qwen2")
    train, test = make_arithmetic_splits(root / "data", n_train=2000, n_test=64)
    sft = root / "tiny-qwen2-sft"
    run_sft(str(base), str(train), str(test), str(sft), steps=60, batch_size=32, eval_size=64)
    return {"base": base, "sft": sft, "train": train, "test": test}


@pytest.fixture(scope="session")
def engine(assets):
    """One engine for the session: starting vLLM takes seconds, which is why syncs are in place."""
    from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES

    return ROLLOUT_ENGINES.get("vllm")(str(assets["sft"]))
