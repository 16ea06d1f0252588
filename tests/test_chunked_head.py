"""The chunked lm head (``kernels.chunked_head``): log-probs, entropy and their gradients equal the
whole-logits computation within float32 rounding, directly and through ``LMPolicy``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.kernels import chunked_head
from rlinf_lightning.kernels.chunked_head import LogitMap, chunked_logprobs, head_mismatch
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.policies.lora import LoRA, attach_lora


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("logit_map", [LogitMap(), LogitMap(scale=3.0, softcap=0.8)], ids=["plain", "mapped"])
def test_values_and_gradients_equal_the_whole_logits(temperature, bias, logit_map):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=bias)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    w_logp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    logits = head(hidden).float()
    if logit_map.softcap:
        logits = torch.tanh(logits * logit_map.scale / logit_map.softcap) * logit_map.softcap
    logits = logits / temperature
    lsm = torch.log_softmax(logits, -1)
    want_logp = lsm.gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(lsm.exp() * lsm).sum(-1)
    want = torch.autograd.grad((want_logp * w_logp + want_ent * w_ent).sum(), [hidden, *head.parameters()])

    logp, ent = chunked_logprobs(hidden, head, targets, temperature, chunk=4, logit_map=logit_map)  # 6 chunks
    got = torch.autograd.grad((logp * w_logp + ent * w_ent).sum(), [hidden, *head.parameters()])
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_under_bf16_autocast_the_matmuls_run_in_bf16_as_the_whole_logits_do():
    """Float32 master weights under CPU bf16 autocast (``trainer.precision: bf16-mixed``): the
    head's matmuls run in bf16 as ``head(hidden)`` would, forward and backward, so log-probs and
    gradients equal the whole logits' within bf16 rounding, and the weight's gradient is float32."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 32, generator=g, requires_grad=True)
    head = torch.nn.Linear(32, 70, bias=False)
    targets = torch.randint(0, 70, (2, 9), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lsm = torch.log_softmax(head(hidden).float(), -1)
        want_logp = lsm.gather(-1, targets[..., None]).squeeze(-1)
        logp, _ = chunked_logprobs(hidden, head, targets, 1.0, chunk=4, entropy=False)
    want = torch.autograd.grad(want_logp.sum(), [hidden, head.weight])
    got = torch.autograd.grad(logp.sum(), [hidden, head.weight])
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)  # the same bf16 products
    assert got[1].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # bf16 gradients, rounded apart


def test_logprobs_alone_take_no_entropy_gradient():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 30, bias=False)
    targets = torch.randint(0, 30, (2, 5), generator=g)
    lsm = torch.log_softmax(head(hidden), -1)
    want = torch.autograd.grad(lsm.gather(-1, targets[..., None]).sum(), hidden)[0]
    logp, _ = chunked_logprobs(hidden, head, targets, 1.0, chunk=3)
    torch.testing.assert_close(torch.autograd.grad(logp.sum(), hidden)[0], want, atol=1e-6, rtol=1e-5)


def test_the_policy_chunked_equals_whole_logits(tmp_path):
    path = build_tiny_qwen2(tmp_path / "tiny")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0
    batch = TensorDict({"input_ids": ids, "attention_mask": mask, "response_mask": torch.ones(4, 6)}, [4])
    out = {}
    for chunk in (None, 5):
        policy = LMPolicy(str(path), logit_chunk_tokens=chunk)
        policy.configure_model()
        logp, entropy = policy.forward_logprobs(batch, temperature=0.8, with_entropy=True)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad for n, p in policy.model.named_parameters()}
        out[chunk] = (logp.detach(), entropy.detach(), grads)
    torch.testing.assert_close(out[5][0], out[None][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[5][1], out[None][1], atol=1e-5, rtol=0)
    for name, grad in out[None][2].items():
        torch.testing.assert_close(out[5][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _tiny_lm(path, family: str):
    """A tiny causal LM: of a family that maps its lm head's output before the softmax, with the
    map strong enough that forgetting it changes the log-probs by far more than rounding, or
    (``qwen2``) a Qwen2 whose head is not tied to its embedding."""
    import transformers

    kw = dict(
        vocab_size=90,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {
        "gemma2": lambda: transformers.Gemma2Config(final_logit_softcapping=0.5, **kw),
        "granite": lambda: transformers.GraniteConfig(logits_scaling=4.0, **kw),
        "cohere": lambda: transformers.CohereConfig(logit_scale=0.25, **kw),
        "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=False, **kw),
    }[family]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return TensorDict({"input_ids": ids, "attention_mask": mask, "response_mask": torch.ones(3, 6)}, [3])


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_models_that_cap_or_scale_their_logits_get_their_own_logprobs(tmp_path, family):
    """Gemma 2 soft-caps its logits, Granite divides them, Cohere multiplies them: the chunks apply
    the map the config gives (values and gradients equal the model's whole logits)."""
    path = _tiny_lm(tmp_path / family, family)
    out = {}
    for chunk in (None, 5):
        policy = LMPolicy(path, logit_chunk_tokens=chunk)
        policy.configure_model()
        logp, entropy = policy.forward_logprobs(_batch(), temperature=0.8, with_entropy=True)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad for n, p in policy.model.named_parameters()}
        out[chunk] = (logp.detach(), entropy.detach(), grads)
    assert not LogitMap.of(policy.model.config).identity
    torch.testing.assert_close(out[5][0], out[None][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[5][1], out[None][1], atol=1e-5, rtol=0)
    for name, grad in out[None][2].items():
        torch.testing.assert_close(out[5][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_loading_refuses_a_model_whose_logits_the_chunks_would_not_compute(tmp_path, monkeypatch):
    """A model that maps its logits in a way its config does not say (here: Granite's division,
    hidden from the map) fails the probe at load, naming the key and the fix."""
    path = _tiny_lm(tmp_path / "granite", "granite")
    monkeypatch.setattr(chunked_head.LogitMap, "of", classmethod(lambda cls, config: cls()))
    refusal = r"^policy\.logit_chunk_tokens: GraniteForCausalLM's logits .* set it to null"
    with pytest.raises(ValueError, match=refusal):
        LMPolicy(path).configure_model()
    LMPolicy(path, logit_chunk_tokens=None).configure_model()  # whole logits: nothing to check


def test_the_probe_passes_the_models_own_map_and_fails_another(tmp_path):
    policy = LMPolicy(str(build_tiny_qwen2(tmp_path / "tiny")))
    policy.configure_model()
    assert head_mismatch(policy.model, LogitMap()) is None
    assert "differ by up to" in head_mismatch(policy.model, LogitMap(scale=1.5))


def test_an_lm_head_with_lora_adapters_takes_the_whole_logits(tmp_path):
    """The chunks read the head's weight, not its adapters: with ``lm_head`` among LoRA's targets
    (an untied head: a tied one is refused), the log-probs are the adapted model's and the head's
    adapters get gradients."""
    policy = LMPolicy(_tiny_lm(tmp_path / "qwen2", "qwen2"), lora=LoRA(target_modules=["lm_head"]))
    policy.configure_model()
    attach_lora(policy)
    b_weight = next(p for n, p in policy.model.named_parameters() if "lm_head.lora_B" in n)
    with torch.no_grad():
        b_weight.normal_()
    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = policy.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -7:-1]
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -6:, None]).squeeze(-1)
    logp = policy.forward_logprobs(batch)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    logp.sum().backward()
    assert b_weight.grad is not None and b_weight.grad.abs().sum() > 0


def test_compiled_chunks_equal_eager():
    """``trainer.compile`` puts each chunk's math under ``torch.compile`` (fused passes over the
    logits): the same log-probs, entropies and gradients as eager in float32, at a temperature,
    with the entropy's gradient, over chunks of two sizes (21 tokens in chunks of 4: the last is 1)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    w_logp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    out = {}
    torch._dynamo.utils.counters.clear()
    for compiled in (False, True):
        logp, ent = chunked_logprobs(hidden, head, targets, 0.7, chunk=4, compiled=compiled)
        grads = torch.autograd.grad((logp * w_logp + ent * w_ent).sum(), [hidden, head.weight])
        out[compiled] = (logp, ent, *grads)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"], dict(counters)
