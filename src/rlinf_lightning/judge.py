"""math-verify judging, in the calling process or as a judge process of its own.

math-verify's timeouts use SIGALRM, which only works in a process's main thread, so calls from
other threads go to a judge process (``rewards._JudgeProcess``) that runs this file **by path**:
it imports the standard library and math-verify only, never this package (which imports torch),
so a judge is ready in about half a second instead of the 2 s a spawned interpreter needed.

    python .../judge.py <parent_pid> <connection_fd>

It answers each ``(pairs, timeout_s)`` request on the connection with one verdict (see
:func:`judge`) per ``(completion, answer)`` pair, in order, as soon as each is judged.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: this package's modules must not shadow top-level ones

import signal  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from functools import cache  # noqa: E402
from typing import Any  # noqa: E402

#: seconds math-verify may spend on one completion, parsing and comparing together, before it
#: scores 0.0 as a timeout
MATH_VERIFY_TIMEOUT_S = 5.0

#: what a verdict's second element says went wrong ("": nothing)
TIMEOUT, UNPARSED_GOLD = "timeout", "unparsed_gold"

#: what sympy sets up lazily the first time math-verify meets each kind of expression (up to a
#: quarter second: docs/benchmarks.md): judged once where a judge starts, not inside a training step
WARM_UP = (("3^1", "39"), ("3*2", "6"), ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("x+1", "2"), ("12", "12"))

_GOLD_CACHE_SIZE = 65536
_gold: dict[str, list] = {}  # gold answer -> math-verify's parse; never a parse that timed out


class _Deadline(BaseException):
    """A completion's time is up. A ``BaseException``, so that the ``except Exception`` handlers in
    math-verify and sympy let it through to :func:`judge`."""


#: seconds after which an expired deadline is raised again, in case the first was swallowed
_RETRY_S = 0.1


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Deadline` in this (main) thread after ``seconds``. One timer for the whole
    judgement: math-verify's own timeouts apply per parse and per comparison (a completion could
    take several of them), and each of them would cancel this one, so they are switched off.

    A handler's exception is lost when the signal lands in a weakref callback or a ``__del__``
    (Python prints it as "ignored": CI saw sympy's parse run on for 38 s past a 1 s bound after
    one landed in torch's weakref callback), so every expiry re-arms the timer and raises again
    :data:`_RETRY_S` later until the block is left."""
    active = True

    def expire(signum: int, frame: Any) -> None:
        if active:
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            raise _Deadline

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            active = False  # a retry still pending finds nothing to interrupt
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@cache
def share_sympy_namespace() -> None:
    """Give sympy's parser, in this process, its namespace built once.

    ``parse_expr`` without a ``global_dict`` builds one per call by running ``exec("from sympy
    import *")``, and math-verify reaches it for every number it reads (``Number("12")`` goes
    through ``sympify``): that import was most of math-verify's time per completion (profiled:
    docs/benchmarks.md). The namespace is the same every time, so ``parse_expr``
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


@cache
def _disable_own_timeouts() -> None:
    """math-verify warns once that it has no timeout when called without one; :func:`judge` bounds
    every call itself."""
    from math_verify import grader, parser

    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True


def _parse_gold(answer: str) -> list:
    from math_verify import parse

    gold = _gold.get(answer)
    if gold is None:
        gold = parse(answer, parsing_timeout=None)  # a _Deadline here leaves nothing cached
        if len(_gold) >= _GOLD_CACHE_SIZE:
            del _gold[next(iter(_gold))]
        _gold[answer] = gold
    return gold


def judge(completion: str | None, answer: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> tuple[float, str]:
    """math-verify in the calling (main) thread, within ``timeout_s`` in all: the verdict
    ``(score, problem)``, ``problem`` being ``""``, :data:`TIMEOUT` or :data:`UNPARSED_GOLD`
    (math-verify reads nothing in the gold answer). ``completion=None`` only reads the answer."""
    from math_verify import parse, verify

    share_sympy_namespace()
    _disable_own_timeouts()
    try:
        with _deadline(timeout_s):
            gold = _parse_gold(answer)
            if not gold:
                return 0.0, UNPARSED_GOLD
            if completion is None:
                return 0.0, ""
            pred = parse(completion, parsing_timeout=None)
            return (1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0), ""
    except _Deadline:
        return 0.0, TIMEOUT


def warm_up() -> None:
    """Judge :data:`WARM_UP` in this (main) thread, so that sympy's lazy set-up is paid now."""
    for completion, answer in WARM_UP:
        judge(completion, answer, timeout_s=60.0)


def serve(conn: Any) -> None:
    """The judge process's loop (see the module docstring); ends when the parent closes."""
    warm_up()  # before "ready", so start-up is not charged to a call
    conn.send("ready")
    while True:
        try:
            pairs, timeout_s = conn.recv()
        except EOFError:
            return
        for completion, answer in pairs:
            conn.send(judge(completion, answer, timeout_s))


def _exit_with_parent(parent_pid: int) -> None:
    """``flow.lifetime.exit_with_parent``, loaded by path (importing it would import this package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow", "lifetime.py")
    spec = importlib.util.spec_from_file_location("_rlinf_lifetime", path)
    lifetime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifetime)
    lifetime.exit_with_parent(parent_pid)


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    _exit_with_parent(int(sys.argv[1]))
    serve(Connection(int(sys.argv[2])))
