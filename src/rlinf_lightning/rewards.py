"""Rewards: score a micro-batch of completions; looked up by name in :data:`REWARDS`.

A reward is a :class:`Reward` (an object called on a :class:`RewardInput`: completions, gold
answers, prompts, response lengths; with an optional one-time :meth:`Reward.setup`), or a plain
function ``(completion, answer) -> float``, which :func:`load_reward` wraps to score one completion
at a time. Plugins add either with ``REWARDS.register("name", obj)``.

``math_verify`` uses the real ``math-verify`` package: it extracts the final answer from the
completion (LaTeX or plain expression) and checks mathematical equivalence with the gold one. Off
the main thread it judges in a child process, a micro-batch per round trip; it counts what it
could not judge (``timeouts``, ``unparsed_gold``) in the batch's metrics.
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
from dataclasses import dataclass, field
from typing import Any

import torch

from rlinf_lightning import judge
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.judge import MATH_VERIFY_TIMEOUT_S, TIMEOUT, UNPARSED_GOLD
from rlinf_lightning.registry import Registry

log = logging.getLogger(__name__)

#: after a completion's timeout, how long a judge process gets to send its verdict before it is
#: taken as stuck (in native code, where no signal reaches it) and replaced
KILL_GRACE_S = 0.5

Verdict = tuple[float, str]  # (score, problem): see judge.judge


@dataclass
class RewardInput:
    """A micro-batch to score: one entry per completion.

    Args:
        completions: the generated texts.
        answers: each completion's gold answer.
        prompts: the prompt each completion answers (``None`` where the caller has none).
        response_lengths: generated tokens per completion (``None`` where the caller has none).
        metrics: where a reward records what it counts (e.g. ``metrics.sum("timeouts", n)``); the
            reward stage logs them as ``reward/<name>``.
    """

    completions: list[str]
    answers: list[str]
    prompts: list[str] | None = None
    response_lengths: torch.Tensor | None = None
    metrics: Metrics = field(default_factory=Metrics)


class Reward:
    """Scores a micro-batch: ``reward(batch) -> one float per completion`` (a list or a tensor).

    Registered as a class, built with no arguments by every stage that uses it; a subclass may
    override :meth:`setup` (one-time costs paid before the first step, on the worker that scores)
    and :meth:`unreadable_answers` (checked when the task loads its data)."""

    def setup(self) -> None:
        """One-time set-up (imports, a library's lazy initialisation), called before scoring."""

    def __call__(self, batch: RewardInput) -> list[float] | torch.Tensor:
        raise NotImplementedError

    def unreadable_answers(self, answers: list[str]) -> list[str]:
        """The gold answers this reward cannot read (they would score 0.0 whatever the completion)."""
        return []


class PerSample(Reward):
    """A function ``(completion, answer) -> float`` as a :class:`Reward`, one call per completion."""

    def __init__(self, fn: Callable[[str, str], float]) -> None:
        self.fn = fn

    def __call__(self, batch: RewardInput) -> list[float]:
        return [float(self.fn(c, a)) for c, a in zip(batch.completions, batch.answers)]


REWARDS: Registry[type[Reward] | Callable[[str, str], float]] = Registry("reward")


def load_reward(name: str) -> Reward:
    """The reward registered as ``name``: its class built, or its function wrapped."""
    entry = REWARDS.get(name)
    if isinstance(entry, type) and issubclass(entry, Reward):
        return entry()
    return PerSample(entry)


def score(reward: Reward, batch: RewardInput) -> torch.Tensor:
    """``reward(batch)`` as a float tensor, one score per completion (checked)."""
    scores = torch.as_tensor(reward(batch), dtype=torch.float32).reshape(-1)
    if len(scores) != len(batch.completions):
        raise ValueError(
            f"reward {type(reward).__name__} returned {len(scores)} scores for "
            f"{len(batch.completions)} completions; it must return one per completion"
        )
    return scores


class _JudgeProcess:
    """math-verify's timeouts use SIGALRM, which only works in a process's main thread, and one
    pathological completion (``9^{9^{9^{9}}}``) keeps sympy busy for minutes. Off the main thread
    (the ``inprocess`` launcher's workers are threads), calls go to a child process
    (:mod:`rlinf_lightning.judge`, run by path) that runs them in its main thread, a micro-batch per
    request, each completion within the timeout. A judge that sends no verdict within the timeout
    plus :data:`KILL_GRACE_S` is stuck where no signal reaches it: it is killed, the completion
    scores 0.0 as a timeout, and the rest go to a new process. Starting one takes about half a
    second (math-verify's import and warm-up), so they are kept (:class:`_JudgePool`)."""

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

    def __call__(self, pairs: list[tuple[str | None, str]], timeout_s: float) -> list[Verdict]:
        verdicts: list[Verdict] = []
        while len(verdicts) < len(pairs):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            rest = pairs[len(verdicts) :]
            self.conn.send((rest, timeout_s))
            for _ in rest:
                if not self.conn.poll(timeout_s + KILL_GRACE_S):
                    self.close()
                    verdicts.append((0.0, TIMEOUT))
                    break
                verdicts.append(tuple(self.conn.recv()))
        return verdicts

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

    def __call__(self, pairs: list[tuple[str | None, str]], timeout_s: float) -> list[Verdict]:
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
class MathVerify(Reward):
    """1.0 when math-verify judges the completion's final answer equal to the gold answer; 0.0 when
    it does not, or cannot decide within ``timeout_s`` (in any thread or process), or cannot read
    the gold answer. The last two are counted in the batch's metrics as ``timeouts`` and
    ``unparsed_gold``."""

    def __init__(self, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def setup(self) -> None:
        """Pay math-verify's one-time set-up now when calls will judge in this (main) thread; off it
        they go to judge processes, which warm up when they start."""
        if threading.current_thread() is threading.main_thread():
            judge.warm_up()

    def verdicts(self, completions: list[str | None], answers: list[str]) -> list[Verdict]:
        """One ``(score, problem)`` verdict per completion (see ``judge.judge``)."""
        pairs = list(zip(completions, answers))
        if threading.current_thread() is threading.main_thread():
            return [judge.judge(c, a, self.timeout_s) for c, a in pairs]
        return _judges(pairs, self.timeout_s)

    def __call__(self, batch: RewardInput) -> list[float]:
        verdicts = self.verdicts(batch.completions, batch.answers)
        batch.metrics.sum("timeouts", sum(problem == TIMEOUT for _, problem in verdicts))
        batch.metrics.sum("unparsed_gold", sum(problem == UNPARSED_GOLD for _, problem in verdicts))
        return [s for s, _ in verdicts]

    def unreadable_answers(self, answers: list[str]) -> list[str]:
        """Gold answers math-verify reads nothing in, or cannot read within the timeout."""
        distinct = list(dict.fromkeys(answers))
        verdicts = self.verdicts([None] * len(distinct), distinct)
        return [a for a, (_, problem) in zip(distinct, verdicts) if problem]


def check_gold_answers(reward: str, answers: list[str], key: str) -> list[tuple[str, str]]:
    """Read a data set's gold ``answers`` as ``reward`` will, once, when the task loads: a
    ``(key, problem)`` when it reads none of them; a warning with their count when it cannot read
    some (those problems score 0.0 whatever the completion, counted in ``reward/unparsed_gold``)."""
    unreadable = set(load_reward(reward).unreadable_answers(answers))
    if not unreadable:
        return []
    count = sum(a in unreadable for a in answers)
    example = ", ".join(repr(a) for a in sorted(unreadable)[:3])
    if count == len(answers):
        return [(key, f"reward {reward!r} reads none of its {count} gold answers (e.g. {example}); "
                      "check the records' answer field, or choose another task.reward")]  # fmt: skip
    log.warning(
        "%s: reward %r cannot read %d of %d gold answers (e.g. %s); those problems score 0.0 and "
        "count in reward/unparsed_gold", key, reward, count, len(answers), example,
    )  # fmt: skip
    return []


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
