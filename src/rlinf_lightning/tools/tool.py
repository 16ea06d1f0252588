"""Tools: named functions a model calls during a rollout, and the one way every call runs.

A :class:`Tool` is a function ``(argument text) -> reply text`` with a name; built-ins and plugins
register theirs in :data:`TOOLS` (a plugin's entry point calls ``TOOLS.register(...)``) and a task
picks them by name (``task.tools``). Users' complaint about every tool-using trainer is a hung
worker, so nothing an environment runs is trusted: :func:`run_abandonable` runs each call in a
daemon thread and stops waiting after the timeout (the thread is abandoned, the rollout goes on), and an
exception becomes an error message for the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlinf_lightning.registry import Registry


@dataclass(frozen=True)
class Tool:
    """A function the model calls as ``<tag>argument</tag>`` (``tag``: the name unless given)."""

    name: str
    fn: Callable[[str], str]
    tag: str | None = None

    @property
    def call_tag(self) -> str:
        return self.tag or self.name

    def __call__(self, argument: str) -> str:
        return str(self.fn(argument))


TOOLS: Registry[Tool] = Registry("tool")


class MalformedCall(ValueError):
    """A call the environment cannot read (an unknown tool, a call never closed): the model is told
    why, and it is counted as ``tools/malformed``."""


@dataclass(frozen=True)
class Outcome:
    """How a call went: its ``value`` (``None`` unless ``status`` is ``ok``) and, otherwise, why."""

    status: str  # ok | error | malformed | timeout
    value: Any = None
    message: str = ""


def run_abandonable(calls: list[Callable[[], Any]], timeout_s: float) -> list[Outcome]:
    """Each of ``calls`` in a daemon thread of its own, all at once, each waited for at most
    ``timeout_s`` seconds from the start: an exception is an ``error`` (``malformed`` for
    :class:`MalformedCall`), a call still running then a ``timeout`` (its thread is left to
    finish on its own; a daemon thread never keeps the process alive)."""
    boxes: list[dict[str, Any]] = [{} for _ in calls]

    def target(fn: Callable[[], Any], box: dict[str, Any]) -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - anything a user's tool raises is reported
            box["error"] = exc

    threads = [
        threading.Thread(target=target, args=(fn, box), name="rlinf-tool-call", daemon=True)
        for fn, box in zip(calls, boxes)
    ]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    outcomes = []
    for thread, box in zip(threads, boxes):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            outcomes.append(Outcome("timeout", message=f"timed out after {timeout_s:g} s"))
        elif "error" in box:
            exc = box["error"]
            status = "malformed" if isinstance(exc, MalformedCall) else "error"
            outcomes.append(Outcome(status, message=f"{type(exc).__name__}: {exc}"))
        else:
            outcomes.append(Outcome("ok", box.get("value")))
    return outcomes
