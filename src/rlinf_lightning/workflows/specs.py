"""The settings a workflow is built from, as frozen values: a task builds them once from its keys
and hands them to its workflow, whose stages read them (a stage never changes its settings). A
new option is a field here and a line in its reader, not a keyword in every signature between."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.tools.loop import TurnLoop


@dataclass(frozen=True)
class RunSpec:
    """What the trainer tells a task about the run (frozen: a task reads it, never changes it).

    Attributes:
        algorithm: the resolved algorithm object (``trainer.algorithm``).
        train: how the task's learning stage trains: engine, its options, precision.
        seed: seeds data order, sampling and initialisation (``trainer.seed``).
        micro_batch_size: samples per message between stages, as requested
            (``trainer.micro_batch_size``; ``None``: the strategy chooses).
        max_staleness: how many versions the rollout's weights may lag behind the synchronous
            flow's (``trainer.max_staleness``): the workflow's weight sync takes it as its
            ``staleness``, its learner checks it against the versions its samples carry.
    """

    algorithm: Any = None
    train: TrainSpec = field(default_factory=TrainSpec)
    seed: int = 0
    micro_batch_size: int | None = None
    max_staleness: int = 0


@dataclass(frozen=True)
class RolloutSpec:
    """How the reasoning rollout samples, and the shape of what it samples (MathTask's keys).

    Attributes:
        engine: the rollout engine's name (``task.rollout``).
        dtype: its dtype (``task.rollout_dtype``; ``auto`` follows the actor's precision).
        engine_options: its keyword arguments (``task.rollout_engine_options``).
        sampling: temperature, top_p, top_k, max_new_tokens (``task.sampling``).
        group_size: completions per prompt (``task.group_size``).
        prompts: prompts per iteration (``task.rollout_batch_size / task.group_size``).
        prompt_format: how a problem becomes a prompt (``task.prompt_template`` and the chat keys).
        max_prompt_tokens: the longest prompt in tokens (``None``: unknown), for memory estimates.
        eval_prompts: how many prompts an evaluation generates for, for the memory estimate.
        turns: the multi-turn loop of ``task.tools`` / ``task.environment`` (``None``: one turn).
    """

    engine: str = "hf"
    dtype: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group_size: int = 2
    prompts: int = 1
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    max_prompt_tokens: int | None = None
    eval_prompts: int = 0
    turns: TurnLoop | None = None

    @property
    def horizon(self) -> int:
        """The longest response: ``max_new_tokens``, or the multi-turn token budget."""
        return self.sampling.max_new_tokens if self.turns is None else self.turns.max_tokens

    @property
    def temperature(self) -> float:
        """The temperature the log-probs are taken under (1 for a greedy setting)."""
        return self.sampling.temperature if self.sampling.temperature > 0 else 1.0


@dataclass(frozen=True)
class BudgetSpec:
    """How a stage cuts its forwards: ``micro_batch_size`` samples, or micro-batches of at most
    ``max_tokens`` tokens; neither: the plan's memory check chooses a token budget."""

    micro_batch_size: int | None = None
    max_tokens: int | None = None


#: no budget configured: the plan's memory check chooses one (where the stage sizes its own)
NO_BUDGET = BudgetSpec()


@dataclass(frozen=True)
class ReasoningSpec:
    """Everything the reasoning workflow is built from besides the policy and the run.

    Attributes:
        rollout: how samples are drawn (:class:`RolloutSpec`).
        actor: the actor's micro-batches (``task.train_micro_batch_size``,
            ``task.train_max_tokens_per_micro_batch``); the critic's too, unless
            ``task.critic.train_micro_batch_size`` sets its own.
        inference: the reference forward's token budget (``task.inference_max_tokens_per_micro_batch``).
        reward: the correctness reward's name (``task.reward``).
        format_reward: the format reward's name (``task.format_reward``), weighted by ``format_weight``.
        format_weight: ``task.format_weight``.
        critic: the value model of an algorithm reading values (``task.critic``).
        train_problems: ``(prompt, answer)`` of the training set, the reserve of DAPO's dynamic
            sampling (``algorithm.max_sampling_rounds``; empty: none to draw from).
    """

    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    actor: BudgetSpec = field(default_factory=BudgetSpec)
    inference: BudgetSpec = field(default_factory=BudgetSpec)
    reward: str = "math_verify"
    format_reward: str | None = None
    format_weight: float = 0.1
    critic: ValueModel | None = None
    train_problems: tuple[tuple[str, str], ...] = ()

    @property
    def critic_budget(self) -> BudgetSpec:
        """The critic's micro-batches: its own sample count, else the actor's settings."""
        own = self.critic.train_micro_batch_size if self.critic is not None else None
        return BudgetSpec(own or self.actor.micro_batch_size, self.actor.max_tokens)


@dataclass(frozen=True)
class EmbodiedSpec:
    """What the embodied workflows (on-policy and off-policy) are built from besides the policy
    and the run (EmbodiedTask's keys).

    Attributes:
        env: the env's name (``task.env``).
        env_kwargs: what every env is made with (``task.env_kwargs``, and ``task.time_aware``'s switch).
        num_envs: envs stepped in parallel (``task.num_envs``).
        steps: actions per env per iteration (``task.steps``).
        chunk: env steps per action (``task.chunk``).
        group_size: envs per group sharing a reset seed, for GRPO over episodes (1: no groups).
        rollout_dtype: the rollout's autocast dtype (``task.rollout_dtype``).
        train_micro_batch_size: samples per forward/backward in the actor (``task.train_micro_batch_size``).
    """

    env: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    num_envs: int = 1
    steps: int = 1
    chunk: int = 1
    group_size: int = 1
    rollout_dtype: str | None = AUTO_ROLLOUT_DTYPE
    train_micro_batch_size: int | None = None
