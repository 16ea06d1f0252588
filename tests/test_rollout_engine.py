import pytest
import torch

from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning.rollout import pack_samples


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_sampling_does_not_depend_on_batch_composition(assets):
    """Per-(group, sample) seeding: a prompt's completions are the same alone or in a batch."""
    policy = LMPolicy(str(assets["sft"]))
    tok = policy.load_tokenizer()
    engine = HFRolloutEngine(str(assets["sft"]))
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    texts = ["What is 1+2?=", "What is 33+44?=", "What is 7+40?="]
    together = engine.generate(_prompts(tok, texts), [10, 11, 12], 4, params, 0, tok.eos_token_id)
    alone = engine.generate(_prompts(tok, texts[1:2]), [11], 4, params, 0, tok.eos_token_id)
    assert [c.token_ids for c in together[1]] == [c.token_ids for c in alone[0]]
    other_seed = engine.generate(_prompts(tok, texts[1:2]), [11], 4, params, 1, tok.eos_token_id)
    assert [c.token_ids for c in other_seed[0]] != [c.token_ids for c in alone[0]]


def test_rollout_logprobs_match_policy_recompute(assets):
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    tok = policy.load_tokenizer()
    engine = HFRolloutEngine(str(assets["sft"]))
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    ids = _prompts(tok, ["What is 1+2?=", "What is 33+44?=", "What is 5+5?="])
    outs = engine.generate(ids, [0, 1, 2], 4, params, 0, tok.eos_token_id)
    batch = pack_samples(ids, outs, tok.pad_token_id)
    with torch.no_grad():
        recomputed = policy.forward_logprobs(batch, temperature=0.8)
    mask = batch["response_mask"].bool()
    diff = (recomputed - batch["rollout_logprobs"])[mask].abs().max()
    assert diff < 1e-4, diff


def test_update_weights_makes_new_weights_live(assets):
    base = HFRolloutEngine(str(assets["base"]))
    sft = HFRolloutEngine(str(assets["sft"]))
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    ids = _prompts(tok, ["What is 12+30?=", "What is 3+4?="])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    want = [c[0].token_ids for c in sft.generate(ids, [0, 1], 1, greedy, 0, tok.eos_token_id)]
    before = [c[0].token_ids for c in base.generate(ids, [0, 1], 1, greedy, 0, tok.eos_token_id)]
    assert before != want
    base.update_weights(sft.model.named_parameters())
    after = [c[0].token_ids for c in base.generate(ids, [0, 1], 1, greedy, 0, tok.eos_token_id)]
    assert after == want


def test_tokenizer_round_trips_through_auto_tokenizer(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["base"])
    text = "What is 12+30?=\n42 #### \\boxed{x}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.padding_side == "left"


def test_a_weight_sync_that_skips_a_parameter_raises(assets):
    engine = HFRolloutEngine(str(assets["base"]))
    sent = [(n, p) for n, p in HFRolloutEngine(str(assets["sft"])).model.named_parameters()]
    with pytest.raises(RuntimeError, match=r"left 1 rollout parameter.*layers.1.mlp.up_proj"):
        engine.update_weights([(n, p) for n, p in sent if n != "model.layers.1.mlp.up_proj.weight"])


def test_completions_end_at_the_generation_configs_end_tokens_too(assets, tmp_path):
    """``end_token_ids``: the tokenizer's end-of-sequence token, then those of the model's
    ``generation_config.json`` (as ``generate`` and vLLM stop at them); the engine ends a greedy
    completion at the first of them it samples."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from rlinf_lightning.engines.sampling import end_token_ids

    model = shutil.copytree(assets["sft"], tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    assert end_token_ids(tok) == [tok.eos_token_id]
    engine = HFRolloutEngine(str(model))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = _prompts(tok, ["What is 33+44?="])
    (full,) = engine.generate(prompt, [0], 1, greedy, 0, -1)[0]  # -1: never stop early
    eos = tok.eos_token_id
    stop_at = next(t for t in full.token_ids[1:] if t != eos)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [stop_at, eos]}))
    tok = AutoTokenizer.from_pretrained(model)
    assert end_token_ids(tok) == [eos, stop_at]
    (cut,) = engine.generate(prompt, [0], 1, greedy, 0, end_token_ids(tok))[0]
    end = next(i for i, t in enumerate(full.token_ids) if t in (eos, stop_at))
    assert cut.token_ids == full.token_ids[: end + 1] and len(cut.token_ids) < len(full.token_ids)
    tok.eos_token = None  # a tokenizer without one: the generation config's alone
    assert end_token_ids(tok) == [stop_at, eos]
