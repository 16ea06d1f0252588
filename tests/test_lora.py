"""LoRA (peft) on the actor: only adapters train, the rollout gets merged weights, checkpoints hold
the adapters and their base, exports load with ``from_pretrained`` / ``PeftModel``."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.checkpoint import load_checkpoint
from rlinf_lightning.engines import HFRolloutEngine, SamplingParams
from rlinf_lightning.engines.precision import resolve_rollout_dtype
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.errors import CheckpointError
from rlinf_lightning.evaluation import greedy_accuracy
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.policies.lora import LoRA, save_adapters, save_merged
from rlinf_lightning.policies.vla import TinyVLA
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.reasoning.rollout import pack_samples
from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec
from trainer_defaults import logged_metrics, tiny_task, tiny_trainer_kwargs

PROMPTS = ["What is 1+2?=", "What is 33+44?=", "What is 7+40?=", "What is 25+25?="]
# the HF engine's KV-cached log-probs against the actor's full forward; full fine-tuning's gap is
# float32 rounding (~1e-6), and the merged weights add rounding of the same order
LOGPROB_TOLERANCE = 3e-5
#: the samples' temperature (the rollout's)
T08 = RolloutSpec(sampling=SamplingParams(temperature=0.8))


def _rollout(engine: HFRolloutEngine, tok, temperature: float = 0.8, seed: int = 0) -> TensorDict:
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    outs = engine.generate(
        ids, list(range(len(ids))), 4, SamplingParams(temperature, max_new_tokens=6), seed, 2
    )
    batch = TensorDict(pack_samples(ids, outs, tok.pad_token_id), batch_size=[4 * len(PROMPTS)])
    batch["advantage"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(seed))
    batch["policy_version"] = torch.zeros(len(batch), dtype=torch.long)  # sampled by the initial weights
    return batch


def _actor(path, lora: LoRA | None, lr: float = 1e-2) -> ActorStage:
    stage = ActorStage(LMPolicy(str(path), lr=lr, lora=lora), RunSpec(GRPO(), TrainSpec("single")), T08)
    stage.setup(StageContext())
    stage.begin_iteration(1)  # as a worker does before the first micro-batch
    return stage


def _gap(actor: ActorStage, batch: TensorDict) -> float:
    with torch.no_grad():
        recomputed = actor.engine.policy.forward_logprobs(batch, temperature=0.8)
    mask = batch["response_mask"].bool()
    return float((recomputed - batch["rollout_logprobs"])[mask].abs().max())


def test_only_adapters_train_and_the_rollout_matches_the_actor_after_a_sync(assets):
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    engine = HFRolloutEngine(str(assets["sft"]))
    actor = _actor(assets["sft"], LoRA(rank=4, alpha=8))
    before = {n: p.detach().clone() for n, p in actor.engine.policy.model.named_parameters()}
    for seed in range(2):
        actor.process(_rollout(engine, tok, seed=seed))
        actor.end_iteration()
    after = dict(actor.engine.policy.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    adapters = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    assert changed == adapters, sorted(changed ^ adapters)[:5]
    optimized = {id(p) for group in actor.engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(after[n]) for n in adapters}  # no optimizer state for the frozen base

    batch = _rollout(engine, tok, seed=5)
    assert _gap(actor, batch) > 100 * LOGPROB_TOLERANCE  # the engine still has the base
    state = actor.sync_state()
    assert ".base_layer." not in "".join(state.keys()) and "model.embed_tokens.weight" not in state.keys()
    engine.update_weights(state.items(), partial=True)
    assert _gap(actor, _rollout(engine, tok, seed=6)) < LOGPROB_TOLERANCE


def test_the_memory_estimate_counts_optimizer_state_for_adapters_only(assets):
    run = RunSpec(GRPO(), TrainSpec("single"))
    full = ActorStage(LMPolicy(str(assets["sft"])), run, RolloutSpec())
    lora = ActorStage(LMPolicy(str(assets["sft"]), lora=LoRA(rank=8)), run, RolloutSpec())
    n = full.policy.parameter_count()
    trainable = lora.policy.trainable_parameter_count()
    actor = _actor(assets["sft"], LoRA(rank=8))
    assert trainable == sum(p.numel() for p in actor.engine.policy.model.parameters() if p.requires_grad)
    assert 0 < trainable < n
    assert sum(p.nbytes for p in full.memory("cpu", 1, 8)) == 16 * n
    assert sum(p.nbytes for p in lora.memory("cpu", 1, 8)) == 4 * n + 12 * trainable


def _fit(assets, tmp_path, model=None, ckpt_path=None, **over):
    task = tiny_task(assets, eval_size=16)
    policy = LMPolicy(str(model or assets["sft"]), lr=1e-3, lora=LoRA(rank=4, alpha=8))
    summary = RLTrainer(**tiny_trainer_kwargs(tmp_path, **over)).fit(policy, task, ckpt_path=ckpt_path)
    return policy, task, summary


def test_lora_checkpoints_resume_exactly_and_export_adapters_or_a_merged_model(warm_assets, tmp_path):
    assets = warm_assets
    policy, task, full = _fit(assets, tmp_path / "full", max_iterations=4, logger=True)
    _fit(assets, tmp_path / "split", max_iterations=2, logger=True)
    _, _, resumed = _fit(assets, tmp_path / "split", ckpt_path="last", max_iterations=4, logger=True)
    a, b = logged_metrics(tmp_path / "full" / "run"), logged_metrics(tmp_path / "split" / "run", version=1)
    for it in (3, 4):
        for key in ("reward/reward", "rollout/response_length", "actor/loss", "actor/grad_norm"):
            assert a[it][key] == b[it][key], (it, key)
    assert full["eval_accuracy_after"] == resumed["eval_accuracy_after"]

    ckpt = tmp_path / "full" / "run" / "checkpoints" / "iter-000004"
    saved = load_file(str(ckpt / "model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # adapters, not the base
    record = json.loads((ckpt / "lora.json").read_text())
    assert record["base"]["path"] == str(assets["sft"]) and len(record["base"]["sha256"]) == 64
    with pytest.raises(CheckpointError, match=r"trained on base .* sha256 .* resume with the same base"):
        _fit(assets, tmp_path / "full", model=assets["base"], ckpt_path="last", max_iterations=5)

    trained = load_checkpoint(ckpt)[0]["model"]
    merged = save_merged(policy, trained, tmp_path / "merged")
    tok = policy.load_tokenizer()
    prompts, answers = [p.prompt for p in task.test], [p.answer for p in task.test]
    # from_pretrained of the exported directory, in the dtype the run's evaluation generated in
    # (``auto``: bfloat16 where the CPU has native bf16), so the two greedy passes are the same sums
    dtype = resolve_rollout_dtype(task.rollout_dtype, "auto", "cpu", policy.dtype)
    engine = HFRolloutEngine(str(merged), dtype=dtype)
    accuracy = greedy_accuracy(engine, tok, prompts, answers, task.reward, task.sampling.max_new_tokens)
    assert accuracy == full["eval_accuracy_after"]
    adapters = save_adapters(policy, trained, tmp_path / "adapters")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(assets["sft"])), adapters)
    plain = AutoModelForCausalLM.from_pretrained(str(merged))
    ids = torch.tensor([tok("What is 12+30?=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
        with peft_model.disable_adapter():  # the adapters changed the model
            assert not torch.allclose(peft_model(ids).logits, plain(ids).logits, atol=1e-3)


class _PolicyGradient:
    def __call__(self, policy, batch):
        logprob, _, value = policy.evaluate(batch)
        return -(logprob * batch["advantage"]).sum() + (value**2).sum(), len(batch), {}


def test_a_vla_trains_adapters_and_its_heads_and_the_rollout_acts_as_the_actor_after_a_sync():
    from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage
    from rlinf_lightning.workflows.training import TrainStage
    from test_vla import ACTION_DIM, CHUNK, _gens, _obs

    obs = _obs(4)
    policy = TinyVLA(lr=1e-2, lora=LoRA(rank=4, alpha=8))
    policy.configure_spaces(obs, (CHUNK, ACTION_DIM))
    actor = TrainStage(policy, TrainSpec("single"))
    actor.setup(StageContext())
    rollout = EnvRolloutStage(policy)
    rollout.setup(StageContext())
    model = actor.engine.policy.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = rollout.net.act(obs, generators=_gens([0, 1, 2, 3]))
    batch = TensorDict({"obs": obs, "action": batch["action"], "advantage": torch.randn(4)}, batch_size=[4])
    for _ in range(2):
        actor.engine.accumulate(batch, _PolicyGradient())
        actor.engine.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(
        ".lora_" in n or n.split(".")[0] in ("vision", "value_head", "state_proj") for n in changed
    )
    assert any(n.startswith("value_head.") for n in changed) and any(".lora_B." in n for n in changed)
    assert not any(n.startswith("lm.") and ".lora_" not in n for n in changed)  # the LM's base is frozen

    with torch.no_grad():
        value = actor.engine.policy.value(obs)
    assert not torch.allclose(rollout.net.value(obs), value, atol=1e-3)  # the rollout has the old weights
    rollout.apply_sync("actor", actor.sync_state())
    got = rollout.net.act(obs, generators=_gens([0, 1, 2, 3]))
    actions = TensorDict({"obs": obs, "action": got["action"]}, batch_size=[4])
    with torch.no_grad():
        want, _, value = actor.engine.policy.evaluate(actions)
    torch.testing.assert_close(got["logprob"], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["value"], value, atol=1e-5, rtol=0)


def _fused_projections_model(path, family: str) -> str:
    """A tiny causal LM of a family whose projections are not named as Llama's (so LoRA's default
    targets match few or none of its linears)."""
    import transformers

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = {
        "phi3": lambda: transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **kw),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**kw),
    }[family]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_all_linear_adapts_every_linear_but_the_head_and_the_merge_is_the_adapted_model(tmp_path, family):
    """Phi-3 fuses q/k/v (``qkv_proj``) and gate/up; GPT-NeoX names them ``query_key_value``,
    ``dense_h_to_4h``: the default targets are refused naming ``all-linear``, which adapts every
    ``nn.Linear`` but the lm head; the merged weights the rollout receives give the adapted
    model's logits."""
    from rlinf_lightning.policies.lora import attach_lora, merged_weights, sync_names

    path = _fused_projections_model(tmp_path / family, family)
    problems = dict(LMPolicy(path, lora=LoRA(rank=4)).validate_config())
    assert "match no nn.Linear" in problems["lora.target_modules"]
    assert "or [all-linear]" in problems["lora.target_modules"]

    policy = LMPolicy(path, lora=LoRA(rank=4, alpha=8, target_modules=["all-linear"]))
    assert "lora.target_modules" not in dict(policy.validate_config())
    policy.configure_model()
    model = policy.model
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    attach_lora(policy)
    adapted = {
        n.removesuffix(".lora_A.default") for n, _ in model.named_modules() if n.endswith(".lora_A.default")
    }
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert adapted == linears - {head} and len(adapted) == 8  # 4 linears x 2 layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n
    }

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
        ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
        want = model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(path)
        assert not torch.allclose(plain(ids).logits, want, atol=1e-3)  # the adapters change the model
        params = dict(model.named_parameters())
        merged = dict(merged_weights(((n, params[n]) for n in sorted(sync_names(model))), 2.0))
        missing, unexpected = plain.load_state_dict(merged, strict=False)
        assert not unexpected and set(merged) == {f"{n}.weight" for n in adapted}
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft's, on the tied head
def test_a_tied_head_is_refused_as_a_target_and_left_out_of_all_linear(assets):
    """The tiny Qwen2's lm head holds its embedding's weight: an adapter there could not be
    merged into the rollout's weights (the merge would change the embedding too), so naming it is
    refused before anything loads, and ``all-linear`` leaves it out."""
    from rlinf_lightning.policies.lora import attach_lora

    policy = LMPolicy(str(assets["sft"]), lora=LoRA(target_modules=["q_proj", "lm_head"]))
    problem = dict(policy.validate_config())["lora.target_modules"]
    assert problem.startswith("['lm_head'] share their weight with another module (tied embeddings)")
    policy.configure_model()
    with pytest.raises(ValueError, match=r"policy.lora.target_modules: \['lm_head'\] share their weight"):
        attach_lora(policy)

    policy = LMPolicy(str(assets["sft"]), lora=LoRA(target_modules=["all-linear"]))
    policy.configure_model()
    attach_lora(policy)
    adapted = {
        n.removesuffix(".lora_A.default")
        for n, _ in policy.model.named_modules()
        if n.endswith(".lora_A.default")
    }
    layers = policy.model.config.num_hidden_layers
    assert len(adapted) == 7 * layers and not any("lm_head" in n for n in adapted)


def test_bad_lora_settings_are_named_before_any_worker_starts(assets, tmp_path):
    import subprocess

    from trainer_defaults import cli_fit_args

    bad = "--policy.init_args.lora={rank: 0, alpha: 8, target_modules: [qproj]}"
    res = subprocess.run(cli_fit_args(assets, tmp_path, bad), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "policy.lora.rank: must be a positive integer, got 0" in res.stderr
    assert "policy.lora.target_modules: ['qproj'] match no nn.Linear of Qwen2ForCausalLM" in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _launch_actor(assets, engine: str, replicas: int):
    from rlinf_lightning.flow import BatchShape, Workflow
    from rlinf_lightning.launchers import LAUNCHERS
    from rlinf_lightning.strategies import STRATEGIES, Resources

    policy = LMPolicy(str(assets["sft"]), lr=1e-2, lora=LoRA(rank=4, alpha=8))
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec(engine)), T08)
    wf = Workflow("train").chain(actor).role("train", "actor")
    plan = STRATEGIES.resolve("collocated").plan(
        wf, Resources(replicas, threads_per_slot=1), BatchShape(16, 8)
    )
    plan.validate(wf, replicas)
    return LAUNCHERS.get("processes" if replicas > 1 else "inprocess")().launch(wf, plan, timeout_s=300)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_lora_trains_the_same_adapters_on_two_data_parallel_ranks(assets, engine):
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    rollout = HFRolloutEngine(str(assets["sft"]))
    batches = [_rollout(rollout, tok, seed=s) for s in range(2)]
    results = {}
    for name, replicas in (("single", 1), (engine, 2)):
        rt = _launch_actor(assets, name, replicas)
        try:
            for it, batch in enumerate(batches):
                batch["policy_version"] = torch.full((len(batch),), it)  # the weights before it
                rt.run_iteration(it + 1, [batch[:8], batch[8:]])
            results[name] = (
                rt.call("actor", "state_dict", replicas="all")[0]["model"],
                rt.call("actor", "sync_state", replicas="all")[0],
            )
        finally:
            rt.shutdown()
    (weights, synced), (other, other_synced) = results["single"], results[engine]
    assert weights.keys() == other.keys() and all(".lora_" in k for k in weights)
    for key in weights:
        torch.testing.assert_close(other[key], weights[key], atol=1e-4, rtol=1e-4)
    assert set(synced.keys()) == set(other_synced.keys())
