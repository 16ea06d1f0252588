"""The reasoning-RL macro flow (math GRPO) as stages:

    prompts -> rollout -> reward -> advantage -> inference -> actor  (stream)
    actor ==weights==> rollout                                        (sync, once per iteration)

With a critic (``task.critic``, for PPO), the critic stage takes the advantage stage's place: it
estimates each token's value, computes the advantages from them (GAE) and trains the value model
on its own optimizer (``workflows/critic.py``). A KL in the reward puts the inference stage first.

Each stage reads micro-batches of whole prompt groups, so every stage (the group-normalising
advantage included) can work on a micro-batch as soon as it arrives, on whichever replica of its
group took it. The actor trains and is checkpointed (role ``train``); the rollout evaluates (role
``evaluate``). Each stage's ``cost_hint`` is its share of an iteration on the tiny math workload
(its ``time/<stage>`` metric relative to the rollout's).
"""

from __future__ import annotations

import dataclasses

from rlinf_lightning.algorithms.contract import interface_problems, unserved
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.reasoning.advantage import AdvantageStage
from rlinf_lightning.workflows.reasoning.inference import InferenceStage
from rlinf_lightning.workflows.reasoning.reward import RewardStage
from rlinf_lightning.workflows.reasoning.rollout import DynamicSampling, RolloutStage
from rlinf_lightning.workflows.specs import ReasoningSpec, RunSpec

#: what the reasoning workflow gives an algorithm (``algorithms.contract``); an episode is one
#: response, ending at its last token (``response_mask``). With a critic (``task.critic``) it also
#: gives values (``CRITIC_PROVIDES``).
PROVIDES = frozenset(
    {"rewards", "group_ids", LOSS_MASK, "dones", "token_rewards", "old_logprobs", "ref_logprobs",
     "proximal_logprobs"}
)  # fmt: skip
CRITIC_PROVIDES = PROVIDES | {"values"}
#: how to give the workflow a critic, for the refusal of an algorithm that reads values
CRITIC_FIX = "; configure a critic: task.critic: {} in YAML, or --task.critic.lr=1e-4 (policies.ValueModel)"


def reasoning_workflow(policy: LMPolicy, run: RunSpec, spec: ReasoningSpec) -> Workflow:
    """The stages for ``run.algorithm`` and the task's settings (``spec``: with a critic, its
    stage takes the advantage stage's place; with ``train_problems``, DAPO's dynamic sampling
    draws from them); raises :class:`ConfigError` when the algorithm lacks a declared attribute
    (``algorithms.contract.Algorithm``) or reads an input this workflow does not provide (values
    without a critic), a critic is given to an algorithm that reads no values, or mini-batches
    cannot be cut from the batch."""
    given, name = run.algorithm, type(run.algorithm).__name__
    if problems := interface_problems(given):
        raise ConfigError(problems)
    algorithm = given.on_tokens()  # e.g. PPO: its options as one step per token
    critic, rollout = spec.critic, spec.rollout
    provides = PROVIDES if critic is None else CRITIC_PROVIDES
    problems = unserved(algorithm, name, provides, "reasoning", CRITIC_FIX if critic is None else "")
    if critic is not None and "values" not in algorithm.reads:
        problems.append(
            (
                "task.critic",
                f"{name} reads no values, so a critic would train for nothing; remove task.critic "
                "or use trainer.algorithm=ppo",
            )
        )
    if given.target_kl is not None:
        problems.append(("trainer.algorithm.target_kl", "stops env-step PPO early (embodied only); set null"))
    mini, prompts = algorithm.num_mini_batches, rollout.prompts
    if prompts % mini:  # whole groups each: at least one group, >= 2 samples
        divisors = [d for d in range(1, prompts + 1) if prompts % d == 0]
        option = "num_mini_batches" if algorithm is given else "num_minibatches"  # PPO's name
        problems.append(
            (
                f"trainer.algorithm.{option}",
                f"{mini} does not divide the {prompts} prompt groups of an iteration "
                f"(task.rollout_batch_size={prompts * rollout.group_size} / "
                f"task.group_size={rollout.group_size}); a mini-batch is whole groups (advantages "
                f"compare a group's samples): use one of {', '.join(map(str, divisors))}",
            )
        )
    if problems:
        raise ConfigError(problems)
    run = dataclasses.replace(run, algorithm=algorithm)
    advantage = AdvantageStage(algorithm, rollout.horizon)
    if critic is not None:
        from rlinf_lightning.workflows.critic import CriticStage

        value_model = critic.for_policy(policy.model_path)
        advantage = CriticStage(value_model, advantage, run, rollout, spec.critic_budget)
    inference = InferenceStage(policy, run, rollout, spec.inference)
    dynamic = None
    if algorithm.max_sampling_rounds and spec.train_problems:
        scorer = RewardStage(spec.reward, spec.format_reward, spec.format_weight)
        dynamic = DynamicSampling(algorithm.max_sampling_rounds, scorer, list(spec.train_problems))
    return (
        Workflow("reasoning")
        .chain(
            RolloutStage(policy, run, rollout, dynamic),
            RewardStage(spec.reward, spec.format_reward, spec.format_weight),
            # a KL in the reward needs the reference log-probs before the advantages
            *((inference, advantage) if advantage.kl_in_reward else (advantage, inference)),
            ActorStage(policy, run, rollout, spec.actor),
        )
        .sync("actor", "rollout", "weights", staleness=run.max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
