"""MathTask: a dataset of problems with gold answers, a reward, and the reasoning workflow."""

from __future__ import annotations

import heapq
import itertools
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from rlinf_lightning.errors import DataError
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.tasks.base import Task
from rlinf_lightning.tasks.data import Problem, is_pattern, load_problems

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime
    from rlinf_lightning.trainer import RLTrainer


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
    """

    input_keys = ("prompt", "answer", "group_id")
    eval_metric = "accuracy"

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
    ) -> None:
        self.train_path, self.test_path = str(train_path), str(test_path)
        self.prompt_template, self.chat_template = prompt_template, chat_template
        self.system_prompt = system_prompt
        self.reward, self.format_reward, self.format_weight = reward, format_reward, format_weight
        self.eval_size = eval_size
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
        return problems

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
            random.Random(seed * 7919 + epoch).shuffle(order)
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
    def build_workflow(self, policy: Any, trainer: RLTrainer) -> Workflow:
        """The reasoning workflow (rollout, reward, advantage, inference, actor) for ``trainer``'s
        algorithm, engines, sampling and group size."""
        from rlinf_lightning.algorithms import ALGORITHMS
        from rlinf_lightning.workflows.reasoning import reasoning_workflow

        return reasoning_workflow(
            policy=policy,
            algorithm=ALGORITHMS.resolve(trainer.algorithm),
            rollout=trainer.rollout,
            rollout_dtype=trainer.rollout_dtype,
            train=trainer.train_spec,
            sampling=trainer.sampling,
            group_size=trainer.group_size,
            train_micro_batch_size=trainer.train_micro_batch_size,
            train_max_tokens_per_micro_batch=trainer.train_max_tokens_per_micro_batch,
            reward=self.reward,
            format_reward=self.format_reward,
            format_weight=self.format_weight,
            seed=trainer.seed,
            prompt_format=self.prompt_format,
            max_prompt_tokens=self.longest_prompt_tokens(policy),
            eval_prompts=len(self.test),
        )

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

    def inputs(self, iteration: int, micro_batch_size: int, trainer: RLTrainer) -> list[TensorDict]:
        """``rollout_batch_size / group_size`` prompts, in micro-batches of whole prompt groups."""
        per_iteration = trainer.rollout_batch_size // trainer.group_size
        prompts = self.prompts((iteration - 1) * per_iteration, per_iteration, trainer.seed)
        return list(prompts.split(max(1, micro_batch_size // trainer.group_size)))

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
