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

import multiprocessing
import os
import re
import threading
import warnings
from collections.abc import Callable
from functools import cache, lru_cache
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


@cache
def _share_sympy_namespace() -> None:
    """Give sympy's parser, in this process, its namespace built once.

    ``parse_expr`` without a ``global_dict`` builds one per call by running ``exec("from sympy
    import *")``, and math-verify reaches it for every number it reads (``Number("12")`` goes
    through ``sympify``): that import was 80% of math-verify's time per completion here (profiled:
    0.49 of 0.61 s over 1257 numbers). The namespace is the same every time, so ``parse_expr``
    (sympy's, which ``sympify`` imports at each call, and math-verify's own reference) becomes a
    wrapper that passes a copy of one built here (a copy, because ``eval`` may add to it). Every
    result is the same; only the rebuilding is gone."""
    import builtins
    import types

    from math_verify import parser
    from sympy import Max, Min
    from sympy.parsing import sympy_parser

    original, standard = sympy_parser.parse_expr, sympy_parser.standard_transformations
    namespace: dict[str, Any] = {}
    exec("from sympy import *", namespace)  # what parse_expr itself runs, once
    namespace.update({k: v for k, v in vars(builtins).items() if isinstance(v, types.BuiltinFunctionType)})
    namespace.update(max=Max, min=Min)

    def parse_expr(s, local_dict=None, transformations=standard, global_dict=None, evaluate=True):
        global_dict = dict(namespace) if global_dict is None else global_dict
        return original(s, local_dict, transformations, global_dict, evaluate)

    parse_expr.__doc__, parse_expr.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
    sympy_parser.parse_expr = parser.parse_expr = parse_expr


#: what sympy sets up lazily the first time math-verify meets each kind of expression (a power
#: took 240 ms, a product 19 ms): judged once where a judge starts, not inside a training step
_WARM_UP = (("3^1", "39"), ("3*2", "6"), ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("x+1", "2"), ("12", "12"))


def _judge(completion: str, answer: str, timeout_s: int) -> float:
    """math-verify in the calling (main) thread, under its own SIGALRM timeouts."""
    from math_verify import parse, verify

    _share_sympy_namespace()
    gold = _parse_gold(answer, timeout_s)
    pred = parse(completion, parsing_timeout=timeout_s)
    if not pred or not gold:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0


def _judge_loop(conn, parent_pid: int) -> None:
    """The judge process: for each ``(pairs, timeout_s)`` request, judges the ``(completion,
    answer)`` pairs in its main thread and sends each score as soon as it has it."""
    from rlinf_lightning.flow.lifetime import exit_with_parent

    exit_with_parent(parent_pid)
    _warm_up()  # before "ready", so start-up is not charged to a call
    conn.send("ready")
    while True:
        try:
            pairs, timeout_s = conn.recv()
        except EOFError:
            return
        for completion, answer in pairs:
            conn.send(_judge(completion, answer, timeout_s))


class _JudgeProcess:
    """math-verify's timeouts use SIGALRM, which only works in a process's main thread, and one
    pathological completion (``9^{9^{9^{9}}}``) keeps sympy busy for minutes. Off the main thread
    (the ``inprocess`` launcher's workers are threads), calls go to a child process that runs them
    in its main thread, a micro-batch per request; if a completion is not judged within twice the
    timeout the process is killed, the completion scores 0.0, and the rest go to a new process.
    Starting one takes about 2 s (a spawned interpreter imports this package), so they are kept
    (:class:`_JudgePool`)."""

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

    def __call__(self, pairs: list[tuple[str, str]], timeout_s: int) -> list[float]:
        scores: list[float] = []
        while len(scores) < len(pairs):
            if self.proc is None or not self.proc.is_alive():
                self._start()
            rest = pairs[len(scores) :]
            self.conn.send((rest, timeout_s))
            for completion, _ in rest:
                if not self.conn.poll(2 * timeout_s + 1):
                    warnings.warn(
                        f"math-verify took over {2 * timeout_s + 1:.0f} s on a completion "
                        f"({completion[:60]!r}...); scored 0.0",
                        stacklevel=3,
                    )
                    self.close()
                    scores.append(0.0)
                    break
                scores.append(self.conn.recv())
        return scores

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
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
            judge = self._free.pop() if self._free else _JudgeProcess()
        try:
            return judge(pairs, timeout_s)
        finally:
            with self._lock:
                self._free.append(judge)

    def close(self) -> None:
        with self._lock:
            judges, self._free = self._free, []
        for judge in judges:
            judge.close()


_judges = _JudgePool()


def _warm_up() -> None:
    """Judge :data:`_WARM_UP` in this (main) thread, so that sympy's lazy set-up is paid now."""
    for completion, answer in _WARM_UP:
        _judge(completion, answer, MATH_VERIFY_TIMEOUT_S)


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
        return [_judge(c, a, timeout_s) for c, a in pairs]
    return _judges(pairs, timeout_s)


def _warm_up_here() -> None:
    """Pay math-verify's one-time set-up now when calls will judge in this (main) thread; off it
    they go to judge processes, which warm up when they start."""
    if threading.current_thread() is threading.main_thread():
        _warm_up()


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
