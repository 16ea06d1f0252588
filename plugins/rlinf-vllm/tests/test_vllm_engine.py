"""The vLLM engine against the HF reference: same log-probs, same greedy tokens, live weight sync."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, HFRolloutEngine, SamplingParams
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning.rollout import pack_samples

PROMPTS = ["What is 1+2?=", "What is 33+44?=", "What is 7+40?=", "What is 25+25?="]
# vLLM's float32 log-probs against HF's: the largest gap measured here was 1.9e-6 (2026-11-24; the
# issue's earlier run 3e-6), float32 rounding of the same kernels' results; 10x that
LOGPROB_TOLERANCE = 3e-5


def _ids(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]


def _max_logprob_gap(engine, policy, tok, temperature=0.8):
    ids = _ids(tok)
    outs = engine.generate(ids, list(range(len(ids))), 4, SamplingParams(temperature, max_new_tokens=6), 0, 2)
    batch = pack_samples(ids, outs, tok.pad_token_id)
    with torch.no_grad():
        recomputed = policy.forward_logprobs(batch, temperature=temperature)
    mask = batch["response_mask"].bool()
    assert mask.any()
    return float((recomputed - batch["rollout_logprobs"])[mask].abs().max())


def test_registered_through_the_entry_point():
    from rlinf_vllm.engine import VLLMRolloutEngine

    assert ROLLOUT_ENGINES.get("vllm") is VLLMRolloutEngine
    out = subprocess.run(
        [sys.executable, "-m", "rlinf_lightning.cli", "plugins"], capture_output=True, text=True
    )
    assert "vllm (rlinf-vllm 0.1.0)" in out.stdout and "rlinf-vllm" in out.stdout


def test_sampled_logprobs_match_hf_after_an_update_and_sync(assets, engine):
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    tok = policy.load_tokenizer()
    assert _max_logprob_gap(engine, policy, tok) < LOGPROB_TOLERANCE
    # an actor update: every parameter moves (the tied embedding / lm_head included)
    updated = copy.deepcopy(policy)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert _max_logprob_gap(engine, updated, tok) > 100 * LOGPROB_TOLERANCE  # still the old weights
    engine.update_weights(updated.model.named_parameters())
    assert _max_logprob_gap(engine, updated, tok) < LOGPROB_TOLERANCE  # the new weights are live
    engine.update_weights(policy.model.named_parameters())


def test_multi_turn_rows_from_the_prefix_cache_match_the_actor_after_a_sync(assets, engine):
    """Multi-turn samples (each later turn's prompt the context so far, its prefix cached from the
    turn before): the behaviour log-probs equal the actor's, also after a weight sync (a block
    cached under the old weights would not). The prompts are longer than a cache block (32
    tokens on CPU), so the second generation finds their first block cached."""
    from rlinf_lightning.prompts import RAW
    from rlinf_lightning.tools import TurnLoop, environment_factory

    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    tok = policy.load_tokenizer()
    loop = TurnLoop(environment_factory({"class_path": "rlinf_lightning.testing.DigitTurns"}, []), 3, 40)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)

    def gap(actor) -> float:
        ids, outs = loop.generate(engine, tok, RAW, [p * 3 for p in PROMPTS], [0, 1, 2, 3], 4, sampling, 0)
        batch = pack_samples(ids, outs, tok.pad_token_id)
        assert any(0 in c.mask for cs in outs for c in cs)  # replies: several turns
        with torch.no_grad():
            recomputed = actor.forward_logprobs(batch, temperature=1.0)
        mask = batch["response_mask"].bool()
        return float((recomputed - batch["rollout_logprobs"])[mask].abs().max())

    assert gap(policy) < LOGPROB_TOLERANCE
    updated = copy.deepcopy(policy)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(updated.model.named_parameters())
    try:
        assert gap(updated) < LOGPROB_TOLERANCE
    finally:
        engine.update_weights(policy.model.named_parameters())


def test_greedy_tokens_equal_hf_and_sampling_ignores_batch_composition(assets, engine):
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    ids = _ids(tok)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    hf = HFRolloutEngine(str(assets["sft"]))
    want = [c[0].token_ids for c in hf.generate(ids, [0, 1, 2, 3], 1, greedy, 0, tok.eos_token_id)]
    got = [c[0].token_ids for c in engine.generate(ids, [0, 1, 2, 3], 1, greedy, 0, tok.eos_token_id)]
    assert got == want
    sample = SamplingParams(temperature=1.0, max_new_tokens=6)
    together = engine.generate(ids, [10, 11, 12, 13], 4, sample, 0, tok.eos_token_id)
    alone = engine.generate(ids[1:2], [11], 4, sample, 0, tok.eos_token_id)
    assert [c.token_ids for c in together[1]] == [c.token_ids for c in alone[0]]
    assert all(c.token_ids[-1] == tok.eos_token_id or len(c.token_ids) == 6 for cs in together for c in cs)


def test_a_lora_actors_merged_weights_sync_partially_and_match(assets, engine):
    """A LoRA actor (adapters on q, v and up only: vLLM's fused qkv and gate_up layers need their
    other parts from the base checkpoint) trains; its merged weights reach vLLM, log-probs agree.
    (Before the test that starts a second engine: its teardown ends vLLM's parallel state, which
    the session's engine needs to generate.)"""
    from tensordict import TensorDict

    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies.lora import LoRA
    from rlinf_lightning.workflows.reasoning.actor import ActorStage
    from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec

    lora = LoRA(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    policy = LMPolicy(str(assets["sft"]), lr=1e-2, lora=lora)
    rollout = RolloutSpec(sampling=SamplingParams(temperature=0.8))
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec("single")), rollout)
    actor.setup(StageContext())
    tok = actor.policy.load_tokenizer()
    ids = _ids(tok)
    for seed in range(2):
        actor.begin_iteration(seed + 1)  # as a worker does before the first micro-batch
        outs = engine.generate(ids, [0, 1, 2, 3], 4, SamplingParams(0.8, max_new_tokens=6), seed, 2)
        batch = TensorDict(pack_samples(ids, outs, tok.pad_token_id), batch_size=[16])
        batch["advantage"] = torch.randn(16, generator=torch.Generator().manual_seed(seed))
        batch["policy_version"] = torch.full((16,), seed)  # on-policy: the previous version
        actor.process(batch)
        actor.end_iteration()
    trained = actor.engine.policy
    assert _max_logprob_gap(engine, trained, tok) > 100 * LOGPROB_TOLERANCE  # vLLM still has the base
    state = actor.sync_state()
    assert "model.layers.0.self_attn.k_proj.weight" not in state.keys()  # only what changed is sent
    engine.update_weights(state.items(), partial=True)
    assert _max_logprob_gap(engine, trained, tok) < LOGPROB_TOLERANCE
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    engine.update_weights(policy.model.named_parameters())  # back to the base for the other tests


def test_engine_start_leaves_the_trainers_rng_and_threads_alone(assets):
    """vLLM's in-process CPU worker seeds global RNGs and replaces torch.set_num_threads."""
    import random

    torch.manual_seed(7)
    random.seed(7)
    rng, py_rng, set_threads = torch.random.get_rng_state(), random.getstate(), torch.set_num_threads
    ROLLOUT_ENGINES.get("vllm")(str(assets["sft"]))
    assert torch.set_num_threads is set_threads
    assert torch.equal(torch.random.get_rng_state(), rng) and random.getstate() == py_rng


def test_a_weight_sync_that_skips_a_parameter_raises(assets, engine):
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    sent = [(n, p) for n, p in policy.model.named_parameters() if n != "model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(RuntimeError, match=r"weight sync left 1 vLLM parameter\(s\).*layers.0.mlp.down_proj"):
        engine.update_weights(sent)
    engine.update_weights(policy.model.named_parameters())  # the complete sync still works


def test_a_completion_without_log_probs_raises():
    """vLLM's own output type with a token whose log-prob is missing (was filled with 0.0)."""
    from rlinf_vllm.engine import sampled_logprobs
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    full = CompletionOutput(0, "", [5, 6], None, [{5: Logprob(-0.5)}, {6: Logprob(-1.0)}])
    assert sampled_logprobs(full) == [-0.5, -1.0]
    for logprobs in (None, [{5: Logprob(-0.5)}], [{5: Logprob(-0.5)}, {7: Logprob(-1.0)}]):
        with pytest.raises(RuntimeError, match="log-probs for"):
            sampled_logprobs(CompletionOutput(0, "", [5, 6], None, logprobs))


def test_vllm_loads_an_exported_lora_checkpoint_and_samples_as_the_exported_model(assets, tmp_path):
    """``rlinf export`` of a LoRA run (adapters merged) is a directory vLLM starts from: its greedy
    tokens equal the HF engine's on the same directory, its sampled log-probs the policy's.
    (Last: a second engine in the process, as the engine-start test.)"""
    from rlinf_lightning.cli import main
    from rlinf_lightning.policies.lora import LoRA
    from rlinf_lightning.testing import checkpoint_one_update

    checkpoint_one_update(assets["sft"], assets, tmp_path / "run", LoRA(rank=4, alpha=8))
    out = tmp_path / "exported"
    assert main(["export", f"--ckpt_path={tmp_path / 'run'}", f"--output_dir={out}"]) == 0
    policy = LMPolicy(str(out))
    policy.configure_model()
    tok = policy.load_tokenizer()
    exported = ROLLOUT_ENGINES.get("vllm")(str(out))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    want = HFRolloutEngine(str(out)).generate(_ids(tok), [0, 1, 2, 3], 1, greedy, 0, tok.eos_token_id)
    got = exported.generate(_ids(tok), [0, 1, 2, 3], 1, greedy, 0, tok.eos_token_id)
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in want]
    assert _max_logprob_gap(exported, policy, tok) < LOGPROB_TOLERANCE


def _tiny_moe(path):
    """A tiny Qwen3-MoE (4 experts, 2 per token; head_dim 64, which CPU attention takes) with the
    character tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlinf_lightning.assets import build_char_tokenizer

    build_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_moe_models_experts_sync_and_match(tmp_path):
    """A weight sync reaches the experts of an MoE model (on CPU vLLM repacks them after loading,
    which its reload skips): after each of two syncs the log-probs match the actor's. In a fresh
    interpreter: vLLM's parallel groups are process-wide, and a dense engine's lack the MoE one."""
    path = _tiny_moe(tmp_path / "moe")
    run = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def _check_moe_sync(path: str) -> None:
    engine = ROLLOUT_ENGINES.get("vllm")(path)
    policy = LMPolicy(path)
    policy.configure_model()
    tok = policy.load_tokenizer()
    assert _max_logprob_gap(engine, policy, tok) < LOGPROB_TOLERANCE
    updated = copy.deepcopy(policy)
    with torch.no_grad():
        for name, p in updated.named_parameters():
            if ".experts." in name:  # only the experts move: the gap is theirs alone
                p.add_(torch.randn_like(p) * 0.05)
    assert _max_logprob_gap(engine, updated, tok) > 100 * LOGPROB_TOLERANCE
    engine.update_weights(updated.model.named_parameters())
    assert _max_logprob_gap(engine, updated, tok) < LOGPROB_TOLERANCE
    engine.update_weights(policy.model.named_parameters())  # and back: a second sync repacks again
    assert _max_logprob_gap(engine, policy, tok) < LOGPROB_TOLERANCE


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _check_moe_sync(sys.argv[1])
