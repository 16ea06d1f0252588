"""The LM policy's response log-probs and entropy, against direct computation."""

import torch

from rlinf_lightning.policies import lm


def reference(logits: torch.Tensor, ids: torch.Tensor, response: int, temperature: float):
    """Unchunked, from a float64 copy: the log-prob of each response token and the entropy."""
    lsm = torch.log_softmax(logits[:, -response - 1 : -1].double() / temperature, -1)
    logp = lsm.gather(-1, ids[:, -response:].unsqueeze(-1)).squeeze(-1)
    return logp, -(lsm.exp() * lsm).sum(-1)


def test_log_probs_and_entropy_from_bf16_logits_across_chunks(monkeypatch):
    monkeypatch.setattr(lm, "ENTROPY_CHUNK_ROWS", 2)  # 5 rows: three chunks, the last short
    logits = (torch.randn(5, 9, 40) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 40, (5, 9))
    for temperature in (1.0, 0.7):
        logp, entropy = lm.response_logprobs(logits, ids, 4, temperature, "value")
        want_logp, want_entropy = reference(logits, ids, 4, temperature)
        assert logp.dtype == torch.float32 and logp.shape == (5, 4)
        assert torch.allclose(logp.double(), want_logp, atol=1e-5)
        assert torch.allclose(entropy.double(), want_entropy, atol=1e-5)


def test_bf16_logits_are_read_exactly_as_their_float32_copy():
    logits = torch.randn(3, 7, 50).to(torch.bfloat16)
    ids = torch.randint(0, 50, (3, 7))
    got, _ = lm.response_logprobs(logits, ids, 4, 1.0)
    want, _ = lm.response_logprobs(logits.float(), ids, 4, 1.0)
    assert torch.equal(got, want)


def test_entropy_with_gradient_only_when_asked():
    logits = torch.randn(2, 5, 10, requires_grad=True)
    ids = torch.randint(0, 10, (2, 5))
    _, value = lm.response_logprobs(logits, ids, 3, 1.0, "value")
    _, grad = lm.response_logprobs(logits, ids, 3, 1.0, "grad")
    assert not value.requires_grad and grad.requires_grad
    assert lm.response_logprobs(logits, ids, 3, 1.0)[1] is None
