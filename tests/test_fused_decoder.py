"""``kernels.fused_decoder``: the RMSNorms through ``torch.nn.functional.rms_norm`` (one fused kernel
each way on CUDA), with the values ``transformers`` computes."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rlinf_lightning.kernels.fused_decoder import _forward_is_rms_norm, computes_rms_norm, fuse_rms_norms
from rlinf_lightning.policies import LMPolicy


def _step(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return [logits.detach()] + [p.grad for p in model.parameters()]


def test_fused_rms_norms_give_transformers_values_and_gradients_to_the_bit(assets):
    """On a CPU ``rms_norm`` runs transformers' five ops in the same order, so the fused model's
    logits and every gradient equal the original's exactly, in float32 and under bf16 autocast
    (float32 residual stream: the fused path taken); a norm computed otherwise would not."""
    path = str(assets["sft"])
    original, fused = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for _ in range(2))
    layers = original.config.num_hidden_layers
    assert fuse_rms_norms(fused) == 2 * layers + 1  # two a layer and the final norm
    ids = torch.randint(0, original.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    for autocast in (False, True):
        for a, b in zip(_step(original, ids, autocast), _step(fused, ids, autocast), strict=True):
            assert torch.equal(a, b)


def test_the_fused_forward_calls_rms_norm_in_float32_only(monkeypatch):
    """Float32 input and weight go through ``rms_norm``; bf16 keeps transformers' own math, which
    rounds before the weight multiplies (the rollout engine's bf16 model rounds so)."""
    calls = []
    rms_norm = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or rms_norm(*a, **k))
    norm = Qwen2RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    half = copy.deepcopy(norm).to(torch.bfloat16)
    x = torch.randn(4, 16)
    expected = norm(x), half(x.bfloat16())
    assert fuse_rms_norms(norm) + fuse_rms_norms(half) == 2
    assert torch.equal(norm(x), expected[0]) and len(calls) == 1
    assert torch.equal(half(x.bfloat16()), expected[1]) and len(calls) == 1


def test_norms_of_another_layout_keep_their_forward():
    """Gemma's norm multiplies by ``1 + weight``: the probe tells it apart and leaves it alone;
    so does anything not an RMSNorm with a 1-D weight."""
    gemma = GemmaRMSNorm(16)
    gemma.variance_epsilon = 1e-6  # even with the attribute the Llama layout has
    assert not computes_rms_norm(gemma)
    assert fuse_rms_norms(torch.nn.Sequential(gemma, torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))) == 0
    assert computes_rms_norm(Qwen2RMSNorm(16))


def test_the_probe_runs_on_real_tensors_where_the_model_is_fake(assets):
    """``meta_model`` under ``FakeTensorMode`` (the bound's way in ``benchmarks/actor_bound.py``)
    fuses the same norms: the probe leaves the fake mode for its few real numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _forward_is_rms_norm.cache_clear()  # probed afresh, inside the fake mode
    policy = LMPolicy(str(assets["sft"]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy.meta_model()
        norms = [m for m in policy.model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all("forward" in vars(m) for m in norms)
