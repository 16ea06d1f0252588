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
    from rlinf_lightning.testing import build_warm_started

    return build_warm_started(tmp_path_factory.mktemp("vllm-assets"))


@pytest.fixture(scope="session")
def engine(assets):
    """One engine for the session: starting vLLM takes seconds, which is why syncs are in place."""
    from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES

    return ROLLOUT_ENGINES.get("vllm")(str(assets["sft"]))
