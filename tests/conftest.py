"""Shared fixtures: a tiny model and arithmetic data, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    from rlinf_lightning.testing import build_warm_started

    return build_warm_started(tmp_path_factory.mktemp("assets"))
