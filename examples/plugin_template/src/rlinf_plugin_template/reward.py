"""A reward is ``(completion, gold_answer) -> float``."""

from __future__ import annotations

from rlinf_lightning.rewards import math_verify_reward


def concise_math(completion: str, answer: str) -> float:
    """math-verify correctness, halved when the completion is longer than 8 characters."""
    correct = math_verify_reward(completion, answer)
    return correct if len(completion.strip()) <= 8 else correct / 2
