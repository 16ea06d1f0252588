"""The reward stage: scores each completion with the task's reward functions."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.rewards import RewardInput, close_judges, load_reward, score
from rlinf_lightning.workflows.finite import check_finite


class RewardStage(Stage):
    """Scores each completion: ``reward`` (correctness) plus ``format_weight`` x ``format_reward``
    (names in ``rewards.REWARDS``); logs what the rewards count (``timeouts``, ``unparsed_gold``).

    A multi-turn sample whose environment has a ``reward`` method (the rollout's ``env_reward``,
    NaN where there is none) gets that reward instead; ``correct`` (the accuracy) stays the task's
    correctness reward."""

    name = "reward"
    cost_hint = 0.15
    in_keys = ("completion", "answer", "prompt", LOSS_MASK)
    out_keys = ("reward", "correct")
    iteration = 0  # the one running (begin_iteration), for the non-finite guard's message

    def __init__(self, reward: str, format_reward: str | None = None, format_weight: float = 0.0) -> None:
        self.reward, self.format_reward, self.format_weight = reward, format_reward, format_weight

    def setup(self, ctx: StageContext) -> None:
        self.correct_fn = load_reward(self.reward)
        self.format_fn = load_reward(self.format_reward) if self.format_reward else None
        for fn in (self.correct_fn, self.format_fn):
            if fn is not None:  # one-time set-up paid here, not in an iteration
                fn.setup()
        self.metrics = Metrics()

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # no model (a judge process, if any, lives outside the device's budget)

    def teardown(self) -> None:
        close_judges()

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def score(self, inputs: RewardInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reward, correct)`` per completion of ``inputs``."""
        correct = score(self.correct_fn, inputs)
        reward = correct.clone()
        if self.format_fn is not None:
            fmt = score(self.format_fn, inputs)
            reward += self.format_weight * fmt
            inputs.metrics.mean("format", float(fmt.mean()), len(fmt))
        return reward, correct

    def process(self, batch: TensorDict) -> TensorDict:
        inputs = RewardInput(
            list(batch["completion"]),
            list(batch["answer"]),
            list(batch["prompt"]),
            batch[LOSS_MASK].sum(-1),
            self.metrics,
        )
        reward, correct = self.score(inputs)
        if "env_reward" in batch.keys():
            env = batch["env_reward"].to(reward.dtype)
            reward = torch.where(env.isnan(), reward, env)
        check_finite(self.name, self.iteration, "rewards", reward)
        batch["reward"] = reward
        batch["correct"] = correct
        self.metrics.distribution("reward", reward)
        self.metrics.mean("accuracy", float(correct.mean()), len(correct))
        return batch

    def end_iteration(self) -> Metrics:
        return self.metrics.take()
