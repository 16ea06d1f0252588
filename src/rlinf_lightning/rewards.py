"""Rewards: ``(completion, gold_answer) -> float``, looked up by name in :data:`REWARDS`.

``math_verify`` uses the real ``math-verify`` package: it extracts the final answer from the
completion (LaTeX or plain expression) and checks mathematical equivalence with the gold one.
Plugins add rewards with ``REWARDS.register("name", fn)``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from functools import lru_cache

from rlinf_lightning.registry import Registry

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only works in the main thread
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _parse_gold(answer: str):
    from math_verify import parse

    t = _timeout()
    return parse(answer, parsing_timeout=t) if t else parse(answer, parsing_timeout=None)


@REWARDS.register("math_verify")
def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when math-verify judges the completion's final answer equal to the gold answer."""
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    t = _timeout()
    pred = parse(completion, parsing_timeout=t)
    if not pred or not gold:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


@REWARDS.register("exact_match")
def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the gold answer string."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


_NUMBER_ONLY = re.compile(r"^\s*-?\d+(\.\d+)?\s*$")


@REWARDS.register("number_format")
def number_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion is a bare number (the tiny task's expected format)."""
    return 1.0 if _NUMBER_ONLY.match(completion) else 0.0


@REWARDS.register("boxed_format")
def boxed_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion puts its answer in ``\\boxed{}`` (MATH-style format)."""
    return 1.0 if "\\boxed{" in completion else 0.0
