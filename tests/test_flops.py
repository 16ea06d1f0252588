"""MFU's numerator: the model-FLOPs formula agrees with PyTorch's own count of the matmul FLOPs a
real forward and backward executes (on a batch without padding, where both count the same work)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2
from rlinf_lightning.engines.flops import peak_matmul_flops
from rlinf_lightning.policies.lm import causal_lm_train_flops


@pytest.mark.parametrize("seq", [16, 128])
def test_train_flops_formula_matches_counted_flops(tmp_path, seq):
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen2(tmp_path / "m", TinyModelConfig(max_position_embeddings=256))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.randint(4, 100, (4, seq))
    mask = torch.ones_like(ids)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    counted = counter.get_total_flops()
    # eager attention computes the full (non-causal) score matrix: count the masked half too
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    masked_half = 6.0 * layers * hidden * 4 * seq**2
    assert causal_lm_train_flops(model, mask) + masked_half == pytest.approx(counted, rel=0.05)


def test_peak_matmul_flops_is_measured():
    peak = peak_matmul_flops("cpu", torch.float32, torch.get_num_threads())
    assert 1e9 < peak < 1e14  # a real figure for a CPU, neither zero nor a datasheet's GPU number
