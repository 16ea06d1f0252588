"""A reward scores a micro-batch (``rlinf_lightning.rewards.Reward``); a plain function
``(completion, answer) -> float`` registers just as well."""

from __future__ import annotations

from rlinf_lightning.rewards import MathVerify, RewardInput


class ConciseMath(MathVerify):
    """math-verify correctness, halved for completions longer than 8 characters.

    A subclass of ``math_verify``'s reward: its ``setup`` (warm-up), its judge processes and its
    ``timeouts`` / ``unparsed_gold`` counts come with it."""

    def __call__(self, batch: RewardInput) -> list[float]:
        correct = super().__call__(batch)
        return [c if len(text.strip()) <= 8 else c / 2 for c, text in zip(correct, batch.completions)]
