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

from typing import Any

from rlinf_lightning.algorithms.contract import unserved
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.tools.loop import TurnLoop
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.reasoning.advantage import AdvantageStage
from rlinf_lightning.workflows.reasoning.inference import InferenceStage
from rlinf_lightning.workflows.reasoning.reward import RewardStage
from rlinf_lightning.workflows.reasoning.rollout import DynamicSampling, RolloutStage

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


def reasoning_workflow(
    *,
    policy: LMPolicy,
    algorithm: Any,
    rollout: str,
    rollout_dtype: str | None = None,
    rollout_engine_options: dict[str, Any] | None = None,
    train: TrainSpec,
    sampling: SamplingParams,
    group_size: int,
    prompts_per_iteration: int,
    train_micro_batch_size: int | None,
    train_max_tokens_per_micro_batch: int | None = None,
    inference_max_tokens_per_micro_batch: int | None = None,
    reward: str,
    format_reward: str | None,
    format_weight: float,
    seed: int,
    prompt_format: PromptFormat | None = None,
    max_prompt_tokens: int | None = None,
    eval_prompts: int = 0,
    train_problems: list[tuple[str, str]] | None = None,
    critic: ValueModel | None = None,
    max_staleness: int = 0,
    turns: TurnLoop | None = None,
) -> Workflow:
    """The stages for ``algorithm`` (``train_problems``: the reserve prompts of DAPO's dynamic
    sampling; ``critic``: the value model of an algorithm that reads values, whose stage then
    takes the advantage stage's place; ``turns``: multi-turn rollouts with an environment, whose
    token budget is then the horizon); raises :class:`ConfigError` when the algorithm reads an
    input this workflow does not provide (values without a critic), a critic is given to an
    algorithm that reads no values, or mini-batches cannot be cut from the batch."""
    given, name = algorithm, type(algorithm).__name__
    if hasattr(algorithm, "on_tokens"):  # e.g. PPO: its options as one step per token
        algorithm = algorithm.on_tokens()
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
    if getattr(given, "target_kl", None) is not None:
        problems.append(("trainer.algorithm.target_kl", "stops env-step PPO early (embodied only); set null"))
    mini = getattr(algorithm, "num_mini_batches", 1)
    if prompts_per_iteration % mini:  # whole groups each: at least one group, >= 2 samples
        divisors = [d for d in range(1, prompts_per_iteration + 1) if prompts_per_iteration % d == 0]
        option = "num_minibatches" if hasattr(given, "num_minibatches") else "num_mini_batches"  # PPO's name
        problems.append(
            (
                f"trainer.algorithm.{option}",
                f"{mini} does not divide the {prompts_per_iteration} prompt groups of an iteration "
                f"(task.rollout_batch_size={prompts_per_iteration * group_size} / "
                f"task.group_size={group_size}); a mini-batch is whole groups (advantages compare a "
                f"group's samples): use one of {', '.join(map(str, divisors))}",
            )
        )
    if problems:
        raise ConfigError(problems)
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    horizon = sampling.max_new_tokens if turns is None else turns.max_tokens
    advantage = AdvantageStage(algorithm, horizon)
    if critic is not None:
        from rlinf_lightning.workflows.critic import CriticStage

        advantage = CriticStage(
            critic.for_policy(policy.model_path),
            advantage,
            train,
            critic.train_micro_batch_size or train_micro_batch_size,
            train_max_tokens_per_micro_batch,
            prompts_per_iteration,
            seed,
            max_prompt_tokens,
            horizon,
        )
    inference = InferenceStage(
        policy, algorithm, temperature, inference_max_tokens_per_micro_batch, max_prompt_tokens, horizon
    )
    rounds = getattr(algorithm, "max_sampling_rounds", 0)
    dynamic = None
    if rounds and train_problems:
        dynamic = DynamicSampling(rounds, RewardStage(reward, format_reward, format_weight), train_problems)
    return (
        Workflow("reasoning")
        .chain(
            RolloutStage(
                policy,
                rollout,
                sampling,
                group_size,
                seed,
                prompt_format,
                rollout_dtype,
                max_prompt_tokens,
                eval_prompts,
                rollout_engine_options,
                dynamic,
                train.precision,
                turns,
            ),
            RewardStage(reward, format_reward, format_weight),
            # a KL in the reward needs the reference log-probs before the advantages
            *((inference, advantage) if advantage.kl_in_reward else (advantage, inference)),
            ActorStage(
                policy,
                algorithm,
                train,
                temperature,
                train_micro_batch_size,
                train_max_tokens_per_micro_batch,
                horizon,
                prompts_per_iteration,
                seed,
                max_staleness,
                rollout_dtype,
                max_prompt_tokens,
            ),
        )
        .sync("actor", "rollout", "weights", staleness=max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
