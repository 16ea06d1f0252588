"""The actor's token budget (``flow.budget``): the per-token cost model against the peaks measured on
an H200 (it was not fitted to them), the budget chosen for a 141 GB device, activation
checkpointing chosen when the budget without it is small, and the refusal of a device too small."""

from __future__ import annotations

import pytest

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.flow.budget import USEFUL_TOKENS, LayerShape, actor_cost
from rlinf_lightning.kernels.chunked_head import LogitMap
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec

GIB = 2**30
QWEN_05B = LayerShape(hidden=896, intermediate=4864, layers=24, vocab=151936)
QWEN_05B_PARAMS = 494_032_768
H200_BYTES = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory on the H200
#: samples of up to 256 new tokens after prompts of up to 64, 32 prompt groups an iteration
ROLLOUT = RolloutSpec(sampling=SamplingParams(max_new_tokens=256), prompts=32, max_prompt_tokens=64)


def test_the_predictor_is_within_15_percent_of_the_h200_peaks():
    """``benchmarks/gpu.py``'s unchunked actor on the H200 (bf16 autocast, AdamW; responses of
    128-256 tokens after prompts of 24-64: 0.81 of the tokens) peaked at 61.8 and 111.5 GiB."""
    static = QWEN_05B_PARAMS * 18  # float32 weights, gradients, 2 Adam moments; bf16 weight copies
    cost = actor_cost(QWEN_05B, static, residual=4, compute=2, response_fraction=192 / 236)
    for tokens, measured in ((16384, 61.8), (32768, 111.5)):
        predicted = cost.peak(tokens) / GIB
        assert abs(predicted / measured - 1) < 0.15, (tokens, predicted, measured)
    # chunked logits: the step's per-token cost no longer carries the vocabulary
    chunked = actor_cost(QWEN_05B, static, logit_chunk=1024, response_fraction=192 / 236)
    assert chunked.per_token < 0.65 * cost.per_token


def test_the_budget_for_a_141_gb_device_predicts_at_most_80_percent(qwen_dir):
    policy = LMPolicy(str(qwen_dir))
    assert policy.parameter_count() == QWEN_05B_PARAMS
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec("single", {}, "bf16-mixed")), ROLLOUT)
    budget = actor.choose_budget("cuda:0", 0.8 * H200_BYTES, 1, 256)
    assert budget.peak <= 0.8 * H200_BYTES
    parts = actor.memory("cuda:0", 1, 256, budget=budget)
    assert sum(p.nbytes for p in parts) == pytest.approx(budget.peak, rel=1e-6)
    assert 16384 <= budget.tokens < 256 * 320 and budget.cuts
    assert not budget.checkpointing and not policy.gradient_checkpointing
    assert actor.max_tokens is None  # choosing changes nothing
    actor.apply_budget(budget)  # what the workers start with
    assert actor.max_tokens == budget.tokens
    actor.apply_budget(None)
    assert actor.max_tokens is None and actor.budget_applied is None


def test_a_small_device_turns_checkpointing_on_and_a_tiny_one_is_refused(qwen_dir):
    policy = LMPolicy(str(qwen_dir))
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec("single", {}, "bf16-mixed")), ROLLOUT)
    static = sum(p.nbytes for p in actor.memory("cuda:0", 1, 256))
    budget = actor.choose_budget("cuda:0", static + 8 * GIB, 1, 256)  # 8 GiB beside the state
    assert budget.checkpointing and budget.checkpointing_chosen and USEFUL_TOKENS <= budget.tokens
    assert budget.peak <= static + 8 * GIB
    assert policy.gradient_checkpointing is None  # chosen, not yet in force
    actor.apply_budget(budget)
    assert policy.gradient_checkpointing is True and actor.max_tokens == budget.tokens
    assert actor.choose_budget("cuda:0", static + 8 * GIB, 1, 256) == budget  # in force, chosen alike
    actor.apply_budget(None)
    assert policy.gradient_checkpointing is None  # what the budget chose, it takes back

    policy.gradient_checkpointing = False  # a configured setting is kept
    budget = actor.choose_budget("cuda:0", static + 8 * GIB, 1, 256)
    assert not budget.checkpointing and budget.tokens < USEFUL_TOKENS

    key, why = actor.choose_budget("cuda:0", static + 0.1 * GIB, 1, 256)
    assert key == "task.train_max_tokens_per_micro_batch" and "not one sample of 320 tokens" in why


def test_on_fsdp_the_budget_counts_whole_logits(qwen_dir):
    """An FSDP2-sharded lm head is only gathered inside the model's forward, so the actor takes the
    whole logits there (``LMPolicy.forward_logprobs``), and its budget counts them."""
    costs = {}
    for engine in ("single", "fsdp"):
        train = TrainSpec(engine, {}, "bf16-mixed")
        policy = LMPolicy(str(qwen_dir))
        actor = ActorStage(policy, RunSpec(GRPO(), train), ROLLOUT)
        costs[engine] = actor.budget_cost("cuda:0", 0.0, False)
    assert costs["fsdp"].per_token > costs["single"].per_token + 4 * QWEN_05B.vocab  # the logits a token
    assert costs["fsdp"].fixed == 0 < costs["single"].fixed  # no chunk


def test_a_configured_budget_is_kept_and_its_peak_counted(qwen_dir):
    policy = LMPolicy(str(qwen_dir), logit_chunk_tokens=None)
    train = TrainSpec("single", {}, "bf16-mixed")
    actor = ActorStage(policy, RunSpec(GRPO(), train), ROLLOUT, BudgetSpec(max_tokens=32768))
    assert actor.choose_budget("cuda:0", 1 * GIB, 1, 256) is None and actor.max_tokens == 32768
    parts = actor.memory("cuda:0", 1, 256)
    assert "32,768 tokens (task.train_max_tokens_per_micro_batch)" in parts[-1].what
    assert sum(p.nbytes for p in parts) > H200_BYTES * 0.75  # whole logits at 32k tokens: most of an H200


@pytest.mark.parametrize(
    ("extra", "mapped"),
    [({}, False), ({"logits_scaling": 1.0}, False), ({"final_logit_softcapping": 30.0}, True),
     ({"logits_scaling": 8.0}, True), ({"logit_scale": 0.0625}, True)],
)  # fmt: skip
def test_a_model_that_maps_its_logits_costs_its_chunks_more(tmp_path, extra, mapped):
    """Gemma 2's soft cap, Granite's and Cohere's scales: each chunk also holds the mapped logits
    and the map's derivative in float32 (``kernels.chunked_head``), 8 bytes a token a vocabulary
    entry; a scale of 1 maps nothing. Read from config.json, as the actor stage reads it."""
    import json

    keys = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps({**keys, **extra}))
    assert LogitMap.from_dir(tmp_path).identity is not mapped
    costs = [actor_cost(QWEN_05B, 0.0, logit_chunk=1024, mapped_logits=m).fixed for m in (False, mapped)]
    assert costs[1] - costs[0] == (8 * 151936 * 1024 if mapped else 0)
