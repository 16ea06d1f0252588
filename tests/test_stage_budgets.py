"""The inference and critic stages' token budgets (``flow.budget``, ``flow/token_budget.py``):
a forward without gradients takes far more tokens than the actor's step, the critic's step (a
value head, no vocabulary) takes its own, each chosen and logged; one that cannot fit is refused
in one line naming its key, and a real tiny run with no budget set chooses all three and trains."""

from __future__ import annotations

import logging

import pytest

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import GRPO, PPO
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.token_budget import TokenBudget
from rlinf_lightning.policies import LMPolicy, ValueModel
from rlinf_lightning.workflows.critic import CriticStage
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.reasoning.advantage import AdvantageStage
from rlinf_lightning.workflows.reasoning.inference import InferenceStage
from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec
from trainer_defaults import MetricsRecorder, tiny_task, tiny_trainer_kwargs

GIB = 2**30
H200_BYTES = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory on the H200
USABLE = 0.8 * H200_BYTES
BF16_MIXED = TrainSpec("single", {}, "bf16-mixed")
#: samples of up to 256 new tokens after prompts of up to 64, 32 prompt groups an iteration
ROLLOUT = RolloutSpec(sampling=SamplingParams(max_new_tokens=256), prompts=32, max_prompt_tokens=64)


def _critic(model_dir, max_tokens=None) -> CriticStage:
    ppo = PPO().on_tokens()
    advantage, run = AdvantageStage(ppo, 256), RunSpec(ppo, BF16_MIXED)
    return CriticStage(ValueModel(str(model_dir)), advantage, run, ROLLOUT, BudgetSpec(max_tokens=max_tokens))


def test_the_inference_budget_on_a_141_gb_device_is_larger_than_the_actors(qwen_dir, caplog):
    """4,096 samples of 64 + 256 tokens a message, so that neither budget is the whole message."""
    policy = LMPolicy(str(qwen_dir))
    actor = ActorStage(policy, RunSpec(GRPO(kl_coef=0.01), BF16_MIXED), ROLLOUT)
    inference = InferenceStage(policy, RunSpec(GRPO(kl_coef=0.01)), ROLLOUT)
    with caplog.at_level(logging.INFO, logger="rlinf_lightning.flow.budget"):
        actors = actor.choose_budget("cuda:0", USABLE, 1, 4096)
        chosen = inference.choose_budget("cuda:0", USABLE, 1, 4096)
    assert chosen.tokens > 3 * actors.tokens and chosen.cuts
    assert chosen.tokens < 4096 * 320 and chosen.peak <= USABLE and not chosen.checkpointing
    parts = inference.memory("cuda:0", 1, 4096, budget=chosen)  # the reference's weights, the forward's peak
    assert sum(p.nbytes for p in parts) == pytest.approx(chosen.peak, rel=1e-6) and parts[-1].working
    assert "a forward's activations and logits of " in parts[-1].what and "(chosen)" in parts[-1].what
    assert f"inference: token budget {chosen.tokens:,} per micro-batch" in caplog.text
    inference.apply_budget(chosen)
    assert inference.max_tokens == chosen.tokens
    inference.apply_budget(None)
    assert inference.max_tokens is None and inference.memory("cuda:0", 1, 4096)[-1].what.startswith("float32")

    # without a KL term there is no reference, so nothing to size
    idle = InferenceStage(policy, RunSpec(GRPO()), ROLLOUT)
    assert idle.choose_budget("cuda:0", USABLE, 1, 4096) is None


def test_a_critic_budget_is_chosen_and_logged_and_its_peak_counted(qwen_dir, caplog):
    critic = _critic(qwen_dir)
    actor = ActorStage(LMPolicy(str(qwen_dir), logit_chunk_tokens=None), RunSpec(GRPO(), BF16_MIXED), ROLLOUT)
    with caplog.at_level(logging.INFO, logger="rlinf_lightning.flow.budget"):
        chosen = critic.choose_budget("cuda:0", USABLE, 1, 4096)
        actors = actor.choose_budget("cuda:0", USABLE, 1, 4096)
    assert f"critic: token budget {chosen.tokens:,} per micro-batch" in caplog.text
    assert chosen.peak <= USABLE and chosen.cuts
    # no vocabulary logits: more tokens than the actor with whole logits takes on the same device
    assert chosen.tokens > 1.5 * actors.tokens  # 62,285 against 34,388
    parts = critic.memory("cuda:0", 1, 4096, budget=chosen)
    assert sum(p.nbytes for p in parts) == pytest.approx(chosen.peak, rel=1e-6)
    assert "activations and values of" in parts[-1].what
    critic.apply_budget(chosen)
    assert "at most" in critic.budget(256)[0]  # what an out-of-memory line names in force

    configured = _critic(qwen_dir, max_tokens=4096)  # task.train_max_tokens_per_micro_batch: kept
    assert configured.choose_budget("cuda:0", USABLE, 1, 4096) is None and configured.max_tokens == 4096
    assert (
        "4,096 tokens (task.train_max_tokens_per_micro_batch)" in configured.memory("cuda:0", 1, 64)[-1].what
    )


def test_a_small_device_turns_the_critics_checkpointing_on_unless_configured(qwen_dir):
    critic = _critic(qwen_dir)
    static = sum(p.nbytes for p in critic.memory("cuda:0", 1, 256))
    chosen = critic.choose_budget("cuda:0", static + 4 * GIB, 1, 256)  # 4 GiB beside the state
    assert chosen.checkpointing and critic.policy.gradient_checkpointing is None  # not yet in force
    assert "activation checkpointing" in critic.memory("cuda:0", 1, 256, budget=chosen)[-1].what
    critic.apply_budget(chosen)
    assert critic.policy.gradient_checkpointing is True
    critic.apply_budget(None)
    assert critic.policy.gradient_checkpointing is None  # what the budget chose, it takes back

    critic.policy.gradient_checkpointing = False  # task.critic.gradient_checkpointing=false: kept
    kept = critic.choose_budget("cuda:0", static + 4 * GIB, 1, 256)
    assert not kept.checkpointing and kept.tokens < chosen.tokens
    # the inference stage trains nothing: it never offers checkpointing
    rollout = RolloutSpec(sampling=SamplingParams(max_new_tokens=1), max_prompt_tokens=64)
    inference = InferenceStage(LMPolicy(str(qwen_dir)), RunSpec(GRPO(kl_coef=0.01)), rollout)
    assert inference.checkpointing_options() == [False] and not inference.checkpointing_configured()


def test_a_stage_that_cannot_fit_one_sample_is_refused_naming_its_key(qwen_dir):
    policy = LMPolicy(str(qwen_dir))
    inference = InferenceStage(policy, RunSpec(GRPO(kl_coef=0.01)), ROLLOUT)
    key, why = inference.choose_budget("cuda:0", 2.5 * GIB, 1, 256)  # the weights and little else
    assert key == "task.inference_max_tokens_per_micro_batch" and "\n" not in why
    assert why.startswith("not one sample of 320 tokens fits the inference's device")
    key, why = _critic(qwen_dir).choose_budget("cuda:0", 8 * GIB, 1, 256)
    assert key == "task.train_max_tokens_per_micro_batch" and "critic's device" in why


def test_the_plans_memory_check_refuses_an_inference_that_cannot_fit(assets, tmp_path, monkeypatch):
    """The tiny model on a node whose memory holds the plan's state but not one reference forward:
    ``trainer.validate`` refuses in one line naming the inference stage's key."""
    import rlinf_lightning.flow.memory as memory

    policy = LMPolicy(str(assets["sft"]))
    task = tiny_task(assets, train_micro_batch_size=None, train_max_tokens_per_micro_batch=4096)
    trainer = RLTrainer(**tiny_trainer_kwargs(tmp_path, algorithm=GRPO(kl_coef=0.01)))
    rollout = RolloutSpec(sampling=SamplingParams(max_new_tokens=16), max_prompt_tokens=64)
    inference = InferenceStage(policy, RunSpec(GRPO(kl_coef=0.01)), rollout)
    state = sum(p.nbytes for p in ActorStage(policy, RunSpec(GRPO()), RolloutSpec()).memory("cpu", 1, 16))
    state += sum(p.nbytes for p in inference.memory("cpu", 1, 16))
    monkeypatch.setattr(memory, "host_memory", lambda: int(state / 0.8) + 4096)
    with pytest.raises(ConfigError) as info:
        trainer.validate(policy, task)
    lines = [line for line in str(info.value).splitlines() if "inference" in line]
    assert len(lines) == 1 and lines[0].strip().startswith(
        "task.inference_max_tokens_per_micro_batch: not one"
    ), str(info.value)


def test_a_tiny_run_with_no_budget_set_chooses_every_stages_budget_and_trains(assets, tmp_path, caplog):
    """PPO with a critic and a KL to the reference on the tiny model, no micro-batch size or token
    budget anywhere: the memory check chooses the actor's, the critic's and the inference stage's
    (each logged), and both learners train."""
    rec = MetricsRecorder()
    critic = ValueModel(lr=1e-3)
    task = tiny_task(assets, train_micro_batch_size=None, critic=critic, format_reward="number_format")
    algorithm = PPO(update_epochs=1, num_minibatches=1, kl_coef=0.01)
    trainer = RLTrainer(
        **tiny_trainer_kwargs(tmp_path, max_iterations=2, algorithm=algorithm, callbacks=[rec])
    )
    with caplog.at_level(logging.INFO, logger="rlinf_lightning.flow.budget"):
        trainer.fit(LMPolicy(str(assets["sft"])), task)
    for stage in ("actor", "critic", "inference"):
        assert f"{stage}: token budget " in caplog.text, caplog.text
    assert set(trainer.plan.budgets) == {"actor", "critic", "inference"}  # the plan carries them
    stages = trainer.workflow.stages
    assert all(stages[s].budget_applied == trainer.plan.budgets[s] for s in trainer.plan.budgets)
    assert len(rec.metrics) == 2 and all("critic/value_error" in m and "actor/loss" in m for m in rec.metrics)


def test_an_inference_cut_by_its_budget_gives_the_whole_forwards_log_probs(assets):
    """Six samples of 4-19 tokens, each its own micro-batch under a budget of 24 tokens, against one
    forward over the padded message: the same log-probs (scattered back to their rows)."""
    import torch
    from tensordict import TensorDict

    from rlinf_lightning.engines.rollout import Completion
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.reasoning.rollout import pack_samples

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, 90, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (6,), generator=g)
    ]
    completions = [[Completion(torch.randint(4, 90, (int(n),), generator=g).tolist(), [0.0] * int(n))]
                   for n in torch.randint(1, 9, (6,), generator=g)]  # fmt: skip
    batch = TensorDict(pack_samples(prompts, completions, pad_id=0), batch_size=[6])
    out = {}
    for budget in (None, 24):
        run, budgets = RunSpec(GRPO(kl_coef=0.01)), BudgetSpec(max_tokens=budget)
        stage = InferenceStage(LMPolicy(str(assets["sft"])), run, RolloutSpec(), budgets)
        stage.setup(StageContext("cpu"))
        out[budget] = stage.process(batch.clone())["ref_logprobs"] * batch["response_mask"]
    assert torch.allclose(out[None], out[24], atol=1e-5) and out[24].abs().sum() > 0


def test_checking_plans_changes_nothing_and_each_plan_carries_its_own_budgets(assets, tmp_path, monkeypatch):
    """On a node with room for the tiny model's state and a few samples beside it, the one-worker
    plan and the disaggregated one choose other budgets (activation checkpointing on, the one
    worker's cutting its micro-batches). Ranking them, as auto does, by checking each in turn
    leaves the workflow's stages and the user's policy as they were, and the plan built for the
    one-worker strategy carries the budgets it gets when it is checked alone, not the last
    checked plan's."""
    import rlinf_lightning.flow.memory as memory
    from rlinf_lightning.strategies import STRATEGIES, CollocatedStrategy, Resources

    policy = LMPolicy(str(assets["sft"]))
    task = tiny_task(assets, train_micro_batch_size=None)  # the actor and the inference choose
    trainer = RLTrainer(
        **tiny_trainer_kwargs(tmp_path, devices=2, num_threads=1, algorithm=GRPO(kl_coef=0.01))
    )
    workflow, _ = trainer.build_plan(policy, task)
    shape, slots = task.batch_shape(trainer.run_spec), Resources(2, threads_per_slot=1)
    one = CollocatedStrategy(replicas=1).plan(workflow, slots, shape)
    apart = STRATEGIES.resolve("disaggregated").plan(workflow, slots, shape)
    state = sum(w.nbytes for w in memory.worker_memory(workflow, one, {}))
    monkeypatch.setattr(memory, "host_memory", lambda: int(state / 0.8) + 2**22)
    alone, _ = memory.plan_budgets(workflow, one)
    assert alone["actor"].checkpointing and alone["actor"].cuts  # what a check could have applied

    sized = [n for n, s in workflow.stages.items() if isinstance(s, TokenBudget)]
    stages = {n: (workflow.stages[n].max_tokens, workflow.stages[n].budget_applied) for n in sized}
    ranked = [(p, memory.memory_problems(workflow, p)) for p in (one, apart)]
    assert all(problems == [] for _, problems in ranked)
    assert memory.plan_budgets(workflow, apart)[0] != alone  # another plan, other budgets
    assert policy.gradient_checkpointing is None  # the user's policy object: unchanged by the checks
    assert stages == {n: (workflow.stages[n].max_tokens, workflow.stages[n].budget_applied) for n in stages}
    chosen, problems = memory.with_budgets(workflow, one)
    assert chosen.budgets == alone and problems == [] and one.budgets == {}  # a new plan; `one` kept
