"""The chunked lm head (``policies.chunked_head``): log-probs, entropy and their gradients equal the
whole-logits computation within float32 rounding, directly and through ``LMPolicy``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.policies.chunked_head import chunked_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_whole_logits(temperature, bias):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=bias)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    w_logp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    logits = head(hidden).float() / temperature
    lsm = torch.log_softmax(logits, -1)
    want_logp = lsm.gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(lsm.exp() * lsm).sum(-1)
    want = torch.autograd.grad((want_logp * w_logp + want_ent * w_ent).sum(), [hidden, *head.parameters()])

    logp, ent = chunked_logprobs(hidden, head, targets, temperature, chunk=4)  # 21 tokens: 6 chunks
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
