"""Rewards: ``(completion, gold_answer) -> float``, looked up by name in :data:`REWARDS`.

``math_verify`` uses the real ``math-verify`` package: it extracts the final answer from the
completion (LaTeX or plain expression) and checks mathematical equivalence with the gold one.
Plugins add rewards with ``REWARDS.register("name", fn)``.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rlinf_lightning.registry import Registry

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")


#: whole seconds (SIGALRM) math-verify may spend on one completion before it scores 0.0
MATH_VERIFY_TIMEOUT_S = 5


@lru_cache(maxsize=65536)
def _parse_gold(answer: str, timeout: int):
    from math_verify import parse

    return parse(answer, parsing_timeout=timeout)


def _judge(completion: str, answer: str, timeout_s: int) -> float:
    """math-verify in the calling (main) thread, under its own SIGALRM timeouts."""
    from math_verify import parse, verify

    gold = _parse_gold(answer, timeout_s)
    pred = parse(completion, parsing_timeout=timeout_s)
    if not pred or not gold:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0


def _judge_loop(conn, parent_pid: int) -> None:
    """The judge process: answers ``(completion, answer, timeout_s)`` requests in its main thread."""
    from rlinf_lightning.flow.lifetime import exit_with_parent

    exit_with_parent(parent_pid)
    import math_verify  # noqa: F401 (imported before "ready", so start-up is not charged to a call)

    conn.send("ready")
    while True:
        try:
            completion, answer, timeout_s = conn.recv()
        except EOFError:
            return
        conn.send(_judge(completion, answer, timeout_s))


class _JudgeProcess:
    """math-verify's timeouts use SIGALRM, which only works in a process's main thread, and one
    pathological completion (``9^{9^{9^{9}}}``) keeps sympy busy for minutes. Off the main thread
    (the ``inprocess`` launcher's workers are threads), calls go to a child process that runs them
    in its main thread; if it does not answer within twice the timeout it is killed (and restarted
    for the next call), and the completion scores 0.0."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_judge_loop, args=(child, os.getpid()), daemon=True, name="rlinf-judge"
        )
        self.proc.start()
        child.close()
        try:
            ready = self.conn.poll(120) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"the math-verify judge process did not start (exit code {code})")

    def __call__(self, completion: str, answer: str, timeout_s: int) -> float:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send((completion, answer, timeout_s))
        if self.conn.poll(2 * timeout_s + 1):
            return self.conn.recv()
        warnings.warn(
            f"math-verify took over {2 * timeout_s + 1:.0f} s on a completion ({completion[:60]!r}...); "
            "scored 0.0",
            stacklevel=3,
        )
        self.close()
        return 0.0

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()
        self.proc = self.conn = None


_judges = threading.local()


@REWARDS.register("math_verify")
def math_verify_reward(completion: str, answer: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> float:
    """1.0 when math-verify judges the completion's final answer equal to the gold answer; 0.0 when
    it does not, or cannot decide within ``timeout_s`` (in any thread or process)."""
    if threading.current_thread() is threading.main_thread():
        return _judge(completion, answer, timeout_s)
    if not hasattr(_judges, "judge"):
        _judges.judge = _JudgeProcess()
    return _judges.judge(completion, answer, timeout_s)


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
