"""The LM policy's response log-probs and entropy, against direct computation."""

import torch

from rlinf_lightning.policies import lm


def test_log_softmax_reads_bf16_logits_without_changing_the_result():
    logits = torch.randn(3, 7, 50).to(torch.bfloat16)
    got = lm.response_log_softmax(logits, 4, 1.0)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.log_softmax(logits[:, -5:-1].float(), -1))
    hot = lm.response_log_softmax(logits, 4, 0.7)
    assert torch.allclose(hot, torch.log_softmax(logits[:, -5:-1].float() / 0.7, -1), atol=1e-6)


def test_gather_takes_the_log_prob_of_each_response_token():
    ids = torch.tensor([[5, 1, 2, 3]])
    log_probs = torch.log_softmax(torch.randn(1, 3, 6), -1)
    got = lm.gather_tokens(log_probs, ids)
    assert got.tolist() == [[log_probs[0, t, ids[0, 1 + t]].item() for t in range(3)]]


def test_entropy_is_exact_across_chunks(monkeypatch):
    monkeypatch.setattr(lm, "ENTROPY_CHUNK_ROWS", 4)  # 3 x 5 rows: four chunks, the last short
    logits = torch.randn(3, 5, 40, dtype=torch.float64) * 3
    expected = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    got = lm.token_entropy(torch.log_softmax(logits, -1))
    assert got.shape == (3, 5)
    assert torch.allclose(got, expected, atol=1e-10)
