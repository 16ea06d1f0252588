"""Rewards: ``(completion, gold_answer) -> float``, looked up by name in :data:`REWARDS`.

``math_verify`` uses the real ``math-verify`` package: it extracts the final answer from the
completion (LaTeX or plain expression) and checks mathematical equivalence with the gold one.
Plugins add rewards with ``REWARDS.register("name", fn)``. A reward may also offer
``fn.batch(completions, answers) -> list[float]`` to score a whole micro-batch at once;
:func:`score` uses it when present (``math_verify`` does: off the main thread it judges in a
child process, and one round trip per micro-batch instead of per completion is what keeps that
cheap), and ``fn.warm_up()``, which the reward stage calls at set-up to pay one-time costs there.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from rlinf_lightning import judge
from rlinf_lightning.judge import MATH_VERIFY_TIMEOUT_S
from rlinf_lightning.registry import Registry

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")


class _JudgeProcess:
    """math-verify's timeouts use SIGALRM, which only works in a process's main thread, and one
    pathological completion (``9^{9^{9^{9}}}``) keeps sympy busy for minutes. Off the main thread
    (the ``inprocess`` launcher's workers are threads), calls go to a child process
    (:mod:`rlinf_lightning.judge`, run by path) that runs them in its main thread, a micro-batch per
    request; if a completion is not judged within twice the timeout the process is killed, the
    completion scores 0.0, and the rest go to a new process. Starting one takes about half a second
    (math-verify's import and warm-up), so they are kept (:class:`_JudgePool`)."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        self.conn, child = multiprocessing.Pipe()
        self.proc = subprocess.Popen(
            [sys.executable, judge.__file__, str(os.getpid()), str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        try:
            ready = self.conn.poll(120) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            code = self.proc.poll()
            self.close()
            raise RuntimeError(f"the math-verify judge process did not start (exit code {code})")

    def __call__(self, pairs: list[tuple[str, str]], timeout_s: int) -> list[float]:
        scores: list[float] = []
        while len(scores) < len(pairs):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            rest = pairs[len(scores) :]
            self.conn.send((rest, timeout_s))
            for completion, _ in rest:
                if not self.conn.poll(2 * timeout_s + 1):
                    log.warning(
                        "math-verify took over %.0f s on a completion (%r...); scored 0.0",
                        2 * timeout_s + 1,
                        completion[:60],
                    )
                    self.close()
                    scores.append(0.0)
                    break
                scores.append(self.conn.recv())
        return scores

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.conn.close()
        self.proc = self.conn = None


class _JudgePool:
    """Judge processes shared by the threads of this process: a caller takes a free one (or starts
    one) and gives it back, so as many run as threads judge at once, and a worker thread that ends
    (the ``inprocess`` launcher starts threads per run step) does not take its judge with it."""

    def __init__(self) -> None:
        self._free: list[_JudgeProcess] = []
        self._lock = threading.Lock()

    def __call__(self, pairs: list[tuple[str, str]], timeout_s: int) -> list[float]:
        with self._lock:
            process = self._free.pop() if self._free else _JudgeProcess()
        try:
            return process(pairs, timeout_s)
        finally:
            with self._lock:
                self._free.append(process)

    def close(self) -> None:
        with self._lock:
            judges, self._free = self._free, []
        for process in judges:
            process.close()


_judges = _JudgePool()


def close_judges() -> None:
    """Stop this process's idle judge processes (at the end of a run: a process that runs several
    fits keeps none between them; the next call off the main thread starts a new one)."""
    _judges.close()


@REWARDS.register("math_verify")
def math_verify_reward(completion: str, answer: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> float:
    """1.0 when math-verify judges the completion's final answer equal to the gold answer; 0.0 when
    it does not, or cannot decide within ``timeout_s`` (in any thread or process)."""
    return _math_verify_batch([completion], [answer], timeout_s)[0]


def _math_verify_batch(
    completions: list[str], answers: list[str], timeout_s: int = MATH_VERIFY_TIMEOUT_S
) -> list[float]:
    pairs = list(zip(completions, answers))
    if threading.current_thread() is threading.main_thread():
        return [judge.judge(c, a, timeout_s) for c, a in pairs]
    return _judges(pairs, timeout_s)


def _warm_up_here() -> None:
    """Pay math-verify's one-time set-up now when calls will judge in this (main) thread; off it
    they go to judge processes, which warm up when they start."""
    if threading.current_thread() is threading.main_thread():
        judge.warm_up()


math_verify_reward.batch = _math_verify_batch  # type: ignore[attr-defined]
math_verify_reward.warm_up = _warm_up_here  # type: ignore[attr-defined]


def score(fn: RewardFn, completions: list[str], answers: list[str]) -> list[float]:
    """``fn`` over a micro-batch: its ``batch`` form when it has one, else one call per completion."""
    batch = getattr(fn, "batch", None)
    if batch is not None:
        return list(batch(completions, answers))
    return [fn(c, a) for c, a in zip(completions, answers)]


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
