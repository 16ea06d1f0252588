"""Rewards: score a micro-batch of completions; looked up by name in :data:`REWARDS`.

A reward is a :class:`Reward` (an object called on a :class:`RewardInput`: completions, gold
answers, prompts, response lengths; with an optional one-time :meth:`Reward.setup`), or a plain
function ``(completion, answer) -> float``, which :func:`load_reward` wraps to score one completion
at a time. Plugins add either with ``REWARDS.register("name", obj)``.

The correctness rewards read a completion's final answer, not the whole text (:func:`final_answer`:
the last ``\\boxed{}``, else the text after the last "answer is" / "answer:" / "####" marker, else
the last number), so a completion that restates the question ("To add 37 + 48, we ...") earns
nothing, and an anchored answer that is an expression copied from the prompt ("The answer is
37 + 48") earns nothing either (:func:`copied_from_prompt`). ``math_verify`` judges that answer with
the real ``math-verify`` package (mathematical equivalence with the gold one); off the main thread
it judges in a child process, a micro-batch per round trip; it counts what it could not judge
(``timeouts``, ``unparsed_gold``) in the batch's metrics. ``exact_match`` compares the answer's text.
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

#: where an answer follows: "The answer is 85", "Answer: 85", "final answer = 85", "#### 85"
_MARKER = re.compile(r"\banswer\s*(?:is\b|:|=)|####", re.IGNORECASE)
#: where a marker's answer ends: a sentence's end or a clause's comma, a line's end
_MARKER_END = re.compile(r"[.,;!?](?:\s|$)|\n")
#: a number: a LaTeX fraction, ``a/b``, a decimal, or an integer (thousands commas allowed)
_NUMBER = re.compile(
    r"-?\\d?frac\{\d+\}\{\d+\}|-?\d+(?:\.\d+)?/\d+(?:\.\d+)?|-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
)
#: arithmetic between two numbers (an expression, not a value)
_OPERATION = re.compile(r"\d\s*(?:[-+*/x×÷^]|\\times|\\cdot|\\div)\s*\d")


@dataclass(frozen=True)
class Answer:
    """A completion's final answer: its ``text`` and the ``form`` it was found in (``boxed``,
    ``marker`` or ``number``)."""

    text: str
    form: str

    def for_math_verify(self) -> str:
        """The answer as math-verify reads it best: a boxed one boxed again (its LaTeX)."""
        return f"\\boxed{{{self.text}}}" if self.form == "boxed" else self.text


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), ``None`` without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i].strip()
    return None  # never closed (cut by the token budget): not an answer


def final_answer(completion: str) -> Answer | None:
    """The completion's final answer, in the first form it has (the one the prompt is expected to
    ask for, most explicit first): the content of the last ``\\boxed{}``; else the text after the
    last "answer is" / "answer:" / "answer =" / "####" marker, to the end of its sentence (after
    the last ``=`` in it: "The answer is 41 + 42 = 83" answers 83); else the last number (an
    integer, a decimal, ``a/b`` or ``\\frac{a}{b}``: "59 + 63 = 122" answers 122, a bare "85"
    answers 85). ``None`` when it has none of them."""
    boxed = _last_boxed(completion)
    if boxed:
        return Answer(boxed, "boxed")
    markers = list(_MARKER.finditer(completion))
    if markers:
        tail = completion[markers[-1].end() :]
        end = _MARKER_END.search(tail)
        tail = (tail[: end.start()] if end else tail).rpartition("=")[2]
        tail = tail.strip().strip("*$").strip()
        if tail:
            return Answer(tail, "marker")
    numbers = _NUMBER.findall(completion)
    return Answer(numbers[-1].replace(",", ""), "number") if numbers else None


def copied_from_prompt(answer: Answer, prompt: str | None, gold: str) -> bool:
    """Whether ``answer`` is an expression (arithmetic between numbers) written in ``prompt``, other
    than the gold answer itself: "The answer is 37 + 48" for "What is 37 + 48?" restates the
    question, which math-verify would evaluate to the right value."""
    squeeze = lambda text: re.sub(r"\s+", "", text)  # noqa: E731
    expression = squeeze(answer.text)
    return (
        prompt is not None
        and _OPERATION.search(expression) is not None
        and expression in squeeze(prompt)
        and expression != squeeze(gold)
    )


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
    """1.0 when math-verify judges the completion's final answer (:func:`final_answer`: boxed, after
    an answer marker, or the last number) equal to the gold answer; 0.0 when it does not, when the
    completion has no final answer or its answer is an expression copied from the prompt
    (:func:`copied_from_prompt`), or when math-verify cannot decide within ``timeout_s`` (in any
    thread or process) or cannot read the gold answer. The last two are counted in the batch's
    metrics as ``timeouts`` and ``unparsed_gold``."""

    def __init__(self, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def setup(self) -> None:
        """Pay math-verify's one-time set-up now when calls will judge in this (main) thread; off it
        they go to judge processes, which warm up when they start."""
        if threading.current_thread() is threading.main_thread():
            judge.warm_up()

    def verdicts(self, completions: list[str | None], answers: list[str]) -> list[Verdict]:
        """One ``(score, problem)`` verdict per completion, math-verify reading each whole text
        (see ``judge.judge``; :meth:`__call__` gives it the final answers)."""
        pairs = list(zip(completions, answers))
        if threading.current_thread() is threading.main_thread():
            return [judge.judge(c, a, self.timeout_s) for c, a in pairs]
        return _judges(pairs, self.timeout_s)

    def __call__(self, batch: RewardInput) -> list[float]:
        prompts = batch.prompts or [None] * len(batch.completions)
        finals = []  # "" (nothing to credit) still has its gold answer read, for unparsed_gold
        for completion, prompt, gold in zip(batch.completions, prompts, batch.answers):
            answer = final_answer(completion)
            credible = answer is not None and not copied_from_prompt(answer, prompt, gold)
            finals.append(answer.for_math_verify() if credible else "")
        verdicts = self.verdicts(finals, batch.answers)
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
    """1.0 when the completion's final answer (:func:`final_answer`: boxed, after an answer marker,
    or the last number) is the gold answer's text, stripped."""
    final = final_answer(completion)
    return 1.0 if final is not None and final.text == answer.strip() else 0.0


_NUMBER_ONLY = re.compile(r"^\s*-?\d+(\.\d+)?\s*$")


@REWARDS.register("number_format")
def number_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion is a bare number (the tiny task's expected format)."""
    return 1.0 if _NUMBER_ONLY.match(completion) else 0.0


@REWARDS.register("boxed_format")
def boxed_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion puts its answer in ``\\boxed{}`` (MATH-style format)."""
    return 1.0 if "\\boxed{" in completion else 0.0
