"""A reward scores a micro-batch (``rlinf_lightning.rewards.Reward``); a plain function
``(completion, answer) -> float`` registers just as well."""

from __future__ import annotations

from rlinf_lightning.rewards import MathVerify, RewardInput, number_format_reward


class ConciseMath(MathVerify):
    """math-verify correctness; a wrong answer given concisely (a bare number) still earns 0.1, a
    shaped reward that pays for the format while the policy cannot yet get the answer right.

    A subclass of ``math_verify``'s reward: its ``setup`` (warm-up), its judge processes and its
    ``timeouts`` / ``unparsed_gold`` counts come with it."""

    def __call__(self, batch: RewardInput) -> list[float]:
        correct = super().__call__(batch)
        return [c or 0.1 * number_format_reward(text, "") for c, text in zip(correct, batch.completions)]
