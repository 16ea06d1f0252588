"""The decode loop's counter-based sampling: it samples the softmax (chi-square), a row's tokens
and log-probs do not depend on the rows beside it (up to the model's own rounding) nor on the
masked columns a prefill is padded with, stop ids end a completion, and the static-cache step
(captured as a CUDA graph on a GPU) decodes what the dynamic cache does."""

from __future__ import annotations

import warnings

import pytest
import torch
from scipy.stats import chi2
from torch._dynamo.utils import counters

from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.engines.sampling import counter_uniforms, row_keys, sample_next
from rlinf_lightning.engines.static_decode import StaticDecoder
from rlinf_lightning.seeds import row_seed


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFRolloutEngine:
    return HFRolloutEngine(str(build_tiny_qwen2(tmp_path_factory.mktemp("sampling") / "tiny")))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(probs) - 1))


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (3, 1.0), (-1, 0.7)])
def test_counter_noise_samples_the_softmax(top_k, top_p):
    """12,000 draws (300 rows x 40 steps) of a 6-token vocabulary against the filtered softmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    probs = torch.softmax(logits / 0.8, -1)
    keep = torch.ones(6, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1:
        keep = probs.cumsum(-1) - probs <= top_p
    want = torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum()
    keys = row_keys([row_seed(7, g, 0) for g in range(300)], "cpu")
    counts = torch.zeros(6)
    for step in range(40):
        token, logp = sample_next(logits.expand(300, 6), counter_uniforms(keys, step), 0.8, top_k, top_p)
        counts += torch.bincount(token, minlength=6)
        torch.testing.assert_close(logp, probs.log()[token])  # under the unfiltered distribution
    assert counts[~keep].sum() == 0
    assert _chi_square_p(counts[keep], want[keep]) > 1e-3
    # and it is not merely uniform: a wrong distribution is refused
    assert _chi_square_p(counts[keep], torch.full((int(keep.sum()),), 1 / float(keep.sum()))) < 1e-6


def test_uniforms_are_per_row_and_per_step():
    keys = row_keys([row_seed(0, g, j) for g in range(50) for j in range(4)], "cpu")
    u = torch.stack([counter_uniforms(keys, t) for t in range(20)])
    assert u.min() > 0 and u.max() < 1
    assert len(torch.unique(u)) >= u.numel() - 3  # 24-bit values: ~0.5 birthday collisions expected
    torch.testing.assert_close(counter_uniforms(keys[7:8], 3), u[3, 7:8], rtol=0, atol=0)
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_a_rows_tokens_and_logprobs_do_not_depend_on_the_rows_beside_it(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12)
    prompt = [[5, 6, 7, 8, 9]]
    others = [[10 + (i % 50), 11, 12 + (i % 7), 13, 14] for i in range(255)]
    pair = engine.generate(prompt + others[:1], [3, 900], 1, params, 0, -1)[0][0]
    crowd = engine.generate(prompt + others, [3, *range(1000, 1255)], 1, params, 0, -1)[0][0]
    assert len(pair.token_ids) == 12
    assert pair.token_ids == crowd.token_ids
    # the noise is bit-identical; the model's matmuls over 2 or 256 rows may round differently
    # (measured here: up to 5e-7), which the log-probs inherit
    torch.testing.assert_close(torch.tensor(pair.logprobs), torch.tensor(crowd.logprobs), atol=1e-5, rtol=0)


def test_a_prefill_padded_to_a_multiple_of_8_generates_what_the_unpadded_one_does(engine):
    """``pad_to_multiple_of`` (8 by default) adds masked columns before the prompts (widths 5 and 3
    become 8): the same tokens, and the same log-probs up to rounding, as at the longest prompt's
    width."""
    assert engine.pad_to_multiple_of == 8
    unpadded = HFRolloutEngine(engine.model_path, pad_to_multiple_of=None)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts, groups = [[5, 6, 7, 8, 9], [20, 21, 22]], [0, 1]
    got = engine.generate(prompts, groups, 2, params, 0, -1)
    want = unpadded.generate(prompts, groups, 2, params, 0, -1)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_generation_stops_at_any_of_several_stop_ids(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    free = engine.generate(ids, [0, 1], 3, params, 0, -1)
    seen = [t for cs in free for c in cs for t in c.token_ids[:6]]
    stops = sorted(set(seen))[:2]
    stopped = engine.generate(ids, [0, 1], 3, params, 0, stops)
    assert sum(len(c.token_ids) < 40 for cs in stopped for c in cs) >= 3
    for cs_free, cs in zip(free, stopped):
        for a, b in zip(cs_free, cs):
            end = next((i for i, t in enumerate(a.token_ids) if t in stops), 39)  # same draws until a stop
            assert b.token_ids == a.token_ids[: end + 1] and b.logprobs == a.logprobs[: end + 1]
    single = engine.generate(ids, [0, 1], 3, params, 0, stops[0])
    assert all(c.token_ids[-1] == stops[0] or len(c.token_ids) == 40 for cs in single for c in cs)


def _same_completions(got, want) -> None:
    assert [c.token_ids for cs in got for c in cs] == [c.token_ids for cs in want for c in cs]
    for cs_got, cs_want in zip(got, want):
        for a, b in zip(cs_got, cs_want):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_static_cache_step_decodes_what_the_dynamic_cache_does(engine, compile):
    """The step a GPU captures as a CUDA graph, on this CPU: same tokens, same log-probs, for a
    second rollout of the same shape (the cache reset, the graph replayed) and one of another.
    ``compiled``: ``torch.compile`` with the warm-up steps a GPU runs before its capture (Inductor
    here, without the capture, which only CUDA has; a step that compiles to one graph has no host
    work in it that a capture would refuse). Two bugs this
    caught: the warm-up steps ran on the cache the decode then used, which shifted every token after
    the first (transformers 5.19's static cache writes after its own count of written tokens); and
    they wrote past a cache with no room for them (63 prompt tokens and 1 new one)."""
    sampling = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=10)
    # (prompts, seed, sampling): the first two share a shape (6 rows), the third has 2 rows and
    # fills its cache's 64-token bucket but for the warm-up's room
    rollouts = [
        ([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]], 3, sampling),
        ([[5, 6], [8, 9, 10], [14]], 4, sampling),
        ([list(range(5, 68))], 5, SamplingParams(temperature=0.9, max_new_tokens=1)),
    ]
    want = [engine.generate(ids, list(range(len(ids))), 2, p, seed, -1) for ids, seed, p in rollouts]
    engine.graphs = decoder = StaticDecoder(engine.model, compile=compile)
    graphs = counters["stats"]["unique_graphs"]
    try:
        # recompile_limit 1: Dynamo would run a second shape's step as eager Python; the decoder
        # raises the limit for its step
        with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=1):
            warnings.simplefilter("error")  # a failed capture falls back to eager with a warning
            got = []
            for ids, seed, p in rollouts:
                got.append(engine.generate(ids, list(range(len(ids))), 2, p, seed, -1))
                engine.graphs.release()  # as an offload between rollouts does
    finally:
        engine.graphs = None
    for g, w in zip(got, want):
        _same_completions(g, w)
    # one compiled step per shape (6 rows, then 2): no graph break, none again after a release
    assert counters["stats"]["unique_graphs"] - graphs == (2 if compile else 0)
    assert decoder.captures == 0 and not decoder.failed  # a CUDA graph only on CUDA


def test_weights_moved_without_a_release_make_the_static_step_record_again(engine, caplog):
    """A graph reads the weights where they were when it was captured: a parameter given a new
    tensor (an offload that skipped ``release``, a swapped weight) must make the next rollout record
    the step again, not replay onto freed memory; an unchanged one replays."""
    params = SamplingParams(temperature=0.9, max_new_tokens=6)
    ids = [[5, 6, 7], [8, 9]]
    want = engine.generate(ids, [0, 1], 2, params, 7, -1)
    engine.graphs = StaticDecoder(engine.model, compile=False)
    weight = engine.model.get_input_embeddings().weight
    try:
        with caplog.at_level("INFO", logger="rlinf_lightning.engines.static_decode"):
            engine.generate(ids, [0, 1], 2, params, 7, -1)
            engine.generate(ids, [0, 1], 2, params, 7, -1)  # the same shape and weights: replayed
            assert len(caplog.records) == 1
            weight.data = weight.data.clone()  # the same values at a new address
            _same_completions(engine.generate(ids, [0, 1], 2, params, 7, -1), want)
            assert len(caplog.records) == 2 and "decode step for 4 rows" in caplog.records[-1].message
    finally:
        engine.graphs = None
