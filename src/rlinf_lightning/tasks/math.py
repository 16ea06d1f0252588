"""MathTask: a dataset of problems with gold answers, a reward, and the reasoning workflow."""

from __future__ import annotations

import heapq
import itertools
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, rollout_dtype_problem
from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, SamplingParams, engine_option_problems
from rlinf_lightning.errors import ConfigError, DataError
from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.tasks.base import Task
from rlinf_lightning.tasks.data import Problem, is_pattern, load_problems
from rlinf_lightning.workflows.specs import BudgetSpec, ReasoningSpec, RolloutSpec, RunSpec

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime
    from rlinf_lightning.tools.loop import TurnLoop

#: mixed into the seed of each epoch's shuffle of the training problems (any fixed odd number)
EPOCH_SEED_STRIDE = 7919


class MathTask(Task):
    """Math reasoning from JSONL or Parquet (native, GSM8K-style or MATH-style records).

    Args:
        train_path: training problems: a ``.jsonl`` file, or Parquet (a ``.parquet`` file, a glob
            such as ``gsm8k/main/train-*.parquet``, or a directory of ``.parquet`` files).
        test_path: held-out problems for evaluation, in the same forms.
        reward: correctness reward name (registry ``rlinf_lightning.rewards.REWARDS``).
        format_reward: optional format reward name, added with weight ``format_weight``.
        format_weight: weight of the format reward.
        eval_size: evaluate on the first ``eval_size`` test problems (``None``: all of them).
        prompt_template: the prompt around each problem; ``{prompt}`` marks the problem text (other
            braces, e.g. ``\\boxed{}``, are literal).
        chat_template: wrap prompts in the tokenizer's chat template when it has one (chat models);
            prompts are plain text for a tokenizer without one.
        system_prompt: the chat's system message (``None``: the chat template's default).
        group_size: completions sampled per prompt (GRPO's group; at least 2).
        rollout_batch_size: samples per iteration (prompts x ``group_size``).
        rollout: rollout engine name (``hf``; ``vllm`` with the plugin).
        rollout_dtype: the rollout engine's weights and compute dtype. ``auto`` (default): follow
            the actor, ``bfloat16`` where ``trainer.precision`` resolves to a bf16 one (``auto`` on a
            GPU or a CPU with bf16 hardware), else the policy's ``dtype``; a bf16 rollout beside a
            float32 actor also turns on truncated importance sampling (``tis_cap`` 2) unless the
            algorithm sets ``tis_cap``. ``float32``, ``bfloat16``, ``float16``: that dtype, the
            algorithm as configured; ``None``: the policy's ``dtype``. The actor's weights are cast
            at each sync; ``actor/approx_kl`` measures the log-prob mismatch this causes. Exact
            float32 on both sides: ``trainer.precision=32-true``.
        rollout_engine_options: keyword arguments of the rollout engine, e.g. for ``vllm``
            ``{gpu_memory_utilization: 0.5, tensor_parallel_size: 2}``.
        sampling: temperature, top_p, top_k and max_new_tokens for rollouts.
        train_micro_batch_size: samples per forward/backward in the actor (gradient accumulation;
            default: each arriving micro-batch at once).
        train_max_tokens_per_micro_batch: instead, cut the actor's micro-batches by tokens: samples
            sorted by length, as many per forward/backward as fit ``rows x longest row <= this``.
            Either way each micro-batch is trimmed to its longest prompt and response, so padding
            costs no compute. With neither set, the plan's memory check chooses a token budget
            that fits the actor's device (and the critic's: it takes these keys too; ``docs/gpu.md``).
        inference_max_tokens_per_micro_batch: the token budget of the inference stage's forwards
            (reference log-probs); ``None``: each message in one forward, cut by a budget the
            plan's memory check chooses where it would not fit.
        critic: a value model for an algorithm that reads values (``trainer.algorithm: ppo``):
            its own stage, placed by the plan like the others, with its own optimizer
            (:class:`~rlinf_lightning.policies.ValueModel`; ``critic: {}`` in YAML takes its
            defaults and the policy's ``model_path``; ``--task.critic.lr=...`` sets an option).
        tools: names of tools (registry ``rlinf_lightning.tools.TOOLS``, e.g. ``[calculator]``)
            the policy may call: rollouts become multi-turn, a call ``<calc>12*34</calc>`` ends a
            turn and its reply ``<res>408</res>`` is appended, masked out of the loss
            (``docs/tools.md``). Empty: single-turn.
        environment: instead of ``tools``, an environment class answering the policy's turns,
            ``{class_path, init_args}`` (``reset(problem) -> str``, ``step(turn) -> (reply,
            done)``, ``stop`` strings; ``rlinf_lightning.tools.Environment``); one per sample.
        max_turns: with tools, the policy's turns per sample (a call in the last one gets no reply).
        max_response_tokens: with tools, each sample's budget of response tokens, generated and
            replies together (``sampling.max_new_tokens`` caps each turn); ``None``:
            ``max_turns`` x ``sampling.max_new_tokens`` + (``max_turns`` - 1) x 64, room for a
            reply between turns (``tools.loop.default_budget``), error replies included.
        tool_timeout_s: with tools, how long one call may run before it is abandoned and the
            policy is told it timed out (counted in ``rollout/tools/timeouts``).
    """

    input_keys = ("prompt", "answer", "group_id")
    eval_metric = "accuracy"

    @property
    def headline(self) -> dict[str, str]:  # type: ignore[override]
        """The progress line's metrics: reward and accuracy; with tools, also the share of samples
        that called one, the failed calls and the replies that did not fit."""
        head = {"reward/reward": "reward", "reward/accuracy": "acc"}
        if self.tools or self.environment is not None:
            head |= {"rollout/tools/calling_share": "calling", "rollout/tools/errors": "tool errors",
                     "rollout/tools/replies_cut": "replies cut"}  # fmt: skip
        return head

    def __init__(
        self,
        train_path: str,
        test_path: str,
        reward: str = "math_verify",
        format_reward: str | None = None,
        format_weight: float = 0.1,
        eval_size: int | None = None,
        prompt_template: str = "{prompt}",
        chat_template: bool = True,
        system_prompt: str | None = None,
        group_size: int = 8,
        rollout_batch_size: int = 128,
        rollout: str = "hf",
        rollout_dtype: str | None = AUTO_ROLLOUT_DTYPE,
        rollout_engine_options: dict[str, Any] | None = None,
        sampling: SamplingParams | None = None,
        train_micro_batch_size: int | None = None,
        train_max_tokens_per_micro_batch: int | None = None,
        inference_max_tokens_per_micro_batch: int | None = None,
        critic: ValueModel | None = None,
        tools: list[str] | None = None,
        environment: dict[str, Any] | None = None,
        max_turns: int = 4,
        max_response_tokens: int | None = None,
        tool_timeout_s: float = 5.0,
    ) -> None:
        self.train_path, self.test_path = str(train_path), str(test_path)
        self.group_size, self.rollout_batch_size = group_size, rollout_batch_size
        self.rollout, self.rollout_dtype = rollout, rollout_dtype
        self.rollout_engine_options = dict(rollout_engine_options or {})
        self.sampling = sampling or SamplingParams()
        self.train_micro_batch_size = train_micro_batch_size
        self.train_max_tokens_per_micro_batch = train_max_tokens_per_micro_batch
        self.inference_max_tokens_per_micro_batch = inference_max_tokens_per_micro_batch
        self.prompt_template, self.chat_template = prompt_template, chat_template
        self.system_prompt = system_prompt
        self.reward, self.format_reward, self.format_weight = reward, format_reward, format_weight
        self.eval_size = eval_size
        self.critic = critic
        self.tools, self.environment = list(tools or []), environment
        self.max_turns, self.max_response_tokens = max_turns, max_response_tokens
        self.tool_timeout_s = tool_timeout_s
        self._train: list[Problem] | None = None
        self._test: list[Problem] | None = None
        self._orders: dict[tuple[int, int], list[int]] = {}
        self._prompt_tokens: dict[tuple[str, PromptFormat], int] = {}

    def validate_config(self) -> list[tuple[str, str]]:
        from rlinf_lightning.rewards import REWARDS, check_gold_answers

        problems = [("prompt_template", p) for p in self.prompt_format.problems()]
        for key in ("train_path", "test_path"):
            path = getattr(self, key)
            if not (Path(path).exists() or is_pattern(path)):
                problems.append((key, f"file {path!r} not found; run `rlinf prepare` to generate data"))
                continue
            try:  # read up front (cheap): a bad record fails now, not mid-run
                loaded = getattr(self, key.removesuffix("_path"))
            except DataError as exc:
                problems.append((key, str(exc)))
                continue
            if self.reward in REWARDS:  # and the gold answers as the reward will read them
                problems += check_gold_answers(self.reward, [p.answer for p in loaded], key)
        for key in ("reward", "format_reward"):
            name = getattr(self, key)
            if name is not None and name not in REWARDS:
                problems.append((key, REWARDS.unknown_message(name)))
        if self.eval_size is not None and self.eval_size < 1:
            problems.append(("eval_size", f"must be >= 1 or null, got {self.eval_size}"))
        if self.critic is not None:
            problems += [(f"critic.{k}", m) for k, m in self.critic.validate_config()]
        return problems + self._batch_problems() + self._rollout_problems() + self._turn_problems()

    def _turn_problems(self) -> list[tuple[str, str]]:
        from rlinf_lightning.tools.loop import environment_problems

        try:  # the environment's reset is tried on the first training problem (read by now)
            first = self.train[0].prompt if self.environment is not None else None
        except (DataError, IndexError, OSError):
            first = None  # the data's own problem is reported by key
        problems = environment_problems(self.environment, self.tools, first)
        for key in ("max_turns", "max_response_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.tool_timeout_s <= 0:
            problems.append(("tool_timeout_s", f"must be > 0, got {self.tool_timeout_s}"))
        return problems

    @property
    def turns(self) -> TurnLoop | None:
        """The multi-turn loop of ``tools`` / ``environment`` (``None``: single-turn rollouts)."""
        if not self.tools and self.environment is None:
            return None
        from rlinf_lightning.tools.loop import TurnLoop, default_budget, environment_factory

        budget = self.max_response_tokens or default_budget(self.max_turns, self.sampling.max_new_tokens)
        return TurnLoop(
            environment_factory(self.environment, self.tools), self.max_turns, budget, self.tool_timeout_s
        )

    @property
    def response_tokens(self) -> int:
        """The longest response span: ``sampling.max_new_tokens``, or the multi-turn budget."""
        turns = self.turns
        return self.sampling.max_new_tokens if turns is None else turns.max_tokens

    def _batch_problems(self) -> list[tuple[str, str]]:
        problems = [
            (key, f"must be >= 1, got {getattr(self, key)}")
            for key in (
                "rollout_batch_size",
                "train_micro_batch_size",
                "train_max_tokens_per_micro_batch",
                "inference_max_tokens_per_micro_batch",
            )
            if getattr(self, key) is not None and getattr(self, key) < 1
        ]
        if self.train_micro_batch_size and self.train_max_tokens_per_micro_batch:
            problems.append(
                (
                    "train_max_tokens_per_micro_batch",
                    "set either this or task.train_micro_batch_size (samples), not both",
                )
            )
        if self.group_size < 2:
            problems.append(
                (
                    "group_size",
                    f"must be >= 2 (advantages compare samples of a prompt), got {self.group_size}",
                )
            )
        elif self.rollout_batch_size >= 1 and self.rollout_batch_size % self.group_size:
            nearest = max(1, self.rollout_batch_size // self.group_size) * self.group_size
            problems.append(
                (
                    "rollout_batch_size",
                    f"{self.rollout_batch_size} is not divisible by task.group_size={self.group_size}; "
                    f"use a multiple such as {nearest}",
                )
            )
        return problems

    def _rollout_problems(self) -> list[tuple[str, str]]:
        s, problems = self.sampling, []
        if s.temperature <= 0:
            problems.append(("sampling.temperature", f"must be > 0 for RL sampling, got {s.temperature}"))
        if not 0 < s.top_p <= 1:
            problems.append(("sampling.top_p", f"must be in (0, 1], got {s.top_p}"))
        if s.max_new_tokens < 1:
            problems.append(("sampling.max_new_tokens", f"must be >= 1, got {s.max_new_tokens}"))
        if why := rollout_dtype_problem(self.rollout_dtype):
            problems.append(("rollout_dtype", why))
        if self.rollout not in ROLLOUT_ENGINES:
            return problems + [("rollout", ROLLOUT_ENGINES.unknown_message(self.rollout))]
        return problems + [
            (f"rollout_engine_options.{key}", why)
            for key, why in engine_option_problems(self.rollout, self.rollout_engine_options)
        ]

    @property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat(self.prompt_template, self.chat_template, self.system_prompt)

    @property
    def train(self) -> list[Problem]:
        if self._train is None:
            self._train = load_problems(self.train_path)
        return self._train

    @property
    def test(self) -> list[Problem]:
        if self._test is None:
            test = load_problems(self.test_path)
            self._test = test[: self.eval_size] if self.eval_size else test
        return self._test

    def prompt_index(self, position: int, seed: int) -> int:
        """Which training problem is the ``position``-th of the shuffled, epoch-repeating stream."""
        n = len(self.train)
        epoch, offset = divmod(position, n)
        if (seed, epoch) not in self._orders:
            order = list(range(n))
            random.Random(seed * EPOCH_SEED_STRIDE + epoch).shuffle(order)
            self._orders = {(seed, epoch): order}  # keep only the current epoch
        return self._orders[(seed, epoch)][offset]

    def prompts(self, start: int, count: int, seed: int) -> TensorDict:
        """Prompts ``start .. start+count`` of the stream; ``group_id`` is the stream position."""
        probs = [self.train[self.prompt_index(i, seed)] for i in range(start, start + count)]
        return TensorDict(
            {
                "prompt": [p.prompt for p in probs],
                "answer": [p.answer for p in probs],
                "group_id": torch.arange(start, start + count),
            },
            batch_size=[count],
        )

    # -- Task ------------------------------------------------------------------------------------
    def batch_shape(self, run: RunSpec) -> BatchShape:
        """``rollout_batch_size`` samples in whole prompt groups of ``group_size``."""
        return BatchShape(self.rollout_batch_size, self.group_size, run.micro_batch_size)

    def build_workflow(self, policy: Any, run: RunSpec) -> Workflow:
        """The reasoning workflow (rollout, reward, advantage, inference, actor) for the run's
        algorithm and train engine and this task's rollout settings."""
        from rlinf_lightning.workflows.reasoning import reasoning_workflow

        self._check_token_budget(policy)
        return reasoning_workflow(policy, run, self.workflow_spec(policy))

    def workflow_spec(self, policy: Any) -> ReasoningSpec:
        """This task's keys as the reasoning workflow reads them, built once per workflow (the
        training problems are the reserve of an algorithm with dynamic sampling)."""
        rollout = RolloutSpec(
            engine=self.rollout,
            dtype=self.rollout_dtype,
            engine_options=self.rollout_engine_options,
            sampling=self.sampling,
            group_size=self.group_size,
            prompts=self.rollout_batch_size // self.group_size,
            prompt_format=self.prompt_format,
            max_prompt_tokens=self.longest_prompt_tokens(policy),
            eval_prompts=len(self.test),
            turns=self.turns,
        )
        return ReasoningSpec(
            rollout=rollout,
            actor=BudgetSpec(self.train_micro_batch_size, self.train_max_tokens_per_micro_batch),
            inference=BudgetSpec(max_tokens=self.inference_max_tokens_per_micro_batch),
            reward=self.reward,
            format_reward=self.format_reward,
            format_weight=self.format_weight,
            critic=self.critic,
            train_problems=tuple((p.prompt, p.answer) for p in self.train),
        )

    def _check_token_budget(self, policy: Any) -> None:
        """A token budget below the longest sample (longest prompt + the longest response) would
        train such samples one per forward/backward: refused, naming the smallest budget that works."""
        budget, prompt = self.train_max_tokens_per_micro_batch, self.longest_prompt_tokens(policy)
        response = self.response_tokens
        if budget is None or prompt is None or budget >= prompt + response:
            return
        need = prompt + response
        key = "sampling.max_new_tokens" if self.turns is None else "max_response_tokens"
        why = (
            f"{budget} tokens is less than one sample ({prompt} prompt tokens + task.{key}={response}); "
            f"use at least {need}"
        )
        raise ConfigError([("task.train_max_tokens_per_micro_batch", why)])

    def longest_prompt_tokens(self, policy: Any) -> int | None:
        """Tokens of the longest prompt the rollout sees (train and test problems, laid out by the
        prompt format), for the memory estimate; ``None`` for a policy without a tokenizer. Only
        the 32 longest problems in characters are encoded (tokens grow with characters, and
        encoding every problem of a large set would take seconds). Cached per model directory."""
        if not hasattr(policy, "load_tokenizer"):
            return None
        key = (str(getattr(policy, "model_path", "")), self.prompt_format)
        if key not in self._prompt_tokens:
            longest = heapq.nlargest(32, {p.prompt for p in itertools.chain(self.train, self.test)}, key=len)
            ids = self.prompt_format.encode(policy.load_tokenizer(), longest)
            self._prompt_tokens[key] = max((len(i) for i in ids), default=0)
        return self._prompt_tokens[key]

    def inputs(self, iteration: int, micro_batch_size: int, run: RunSpec) -> list[TensorDict]:
        """``rollout_batch_size / group_size`` prompts, in micro-batches of whole prompt groups."""
        per_iteration = self.rollout_batch_size // self.group_size
        prompts = self.prompts((iteration - 1) * per_iteration, per_iteration, run.seed)
        return list(prompts.split(max(1, micro_batch_size // self.group_size)))

    def evaluate(self, runtime: Runtime) -> dict[str, float]:
        """Greedy accuracy on the held-out problems, on the evaluate-role stage (the rollout)."""
        problems = self.test
        accuracy = runtime.call(
            runtime.workflow.roles["evaluate"],
            "evaluate",
            [p.prompt for p in problems],
            [p.answer for p in problems],
            self.reward,
        )
        return {"accuracy": accuracy, "problems": len(problems)}
