"""Environments: what answers a model's turns in a multi-turn rollout.

The contract (the same shape as TRL's ``environment_factory`` and veRL's agent loop):

* ``reset(problem) -> str``: start a sample; returns the text the prompt is made of (the problem,
  or the problem with instructions);
* ``step(turn) -> (reply, done)``: the model's latest turn (its text since the last reply, ending
  with one of :attr:`Environment.stop`); the reply is appended to the context, masked out of the
  loss, and ``done`` ends the sample there (the reply is then dropped);
* optional ``reward(completion, answer) -> float``: the sample's reward from the environment's
  state, in place of the task's reward function (``completion``: the final turn's text);
* ``stop``: the strings that end a turn besides the end-of-sequence token (a tool call's closing
  tag); a turn ending with the end-of-sequence token is the sample's answer;
* ``error(message) -> str``: the reply for a step that raised, timed out or was malformed.

One environment is built per sample (a task's ``environment: {class_path, init_args}``), so it may
keep state across the sample's turns. :class:`ToolEnvironment` is the one ``task.tools`` builds.
"""

from __future__ import annotations

import numbers
from typing import Any

from rlinf_lightning.errors import RunError
from rlinf_lightning.tools.tool import TOOLS, MalformedCall, Tool

#: each method of the contract, as a broken-contract message states it
CONTRACT = {
    "reset": "return the prompt text (str)",
    "step": "return (reply: str, done: bool)",
    "reward": "return a number",
}


class ContractError(RunError):
    """An environment broke its contract while the run was going: one line naming the contract,
    the class and what it returned (a stage ends the run with it, with no traceback)."""


def _got(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def broken(env: Any, method: str, value: Any) -> str:
    """``"LookupCalc.step must return (reply: str, done: bool), got str '42'"``."""
    return f"{type(env).__qualname__}.{method} must {CONTRACT[method]}, got {_got(value)}"


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's too


def checked_reset(env: Any, problem: str) -> str:
    """``env.reset(problem)``, or :class:`ContractError` when it raises or returns no text."""
    try:
        text = env.reset(problem)
    except Exception as exc:  # noqa: BLE001 - the user's code: named, not a stage traceback
        raise ContractError(
            f"task.environment: {type(env).__qualname__}.reset raised {type(exc).__name__}: {exc} "
            f"(problem {problem[:60]!r})"
        ) from exc
    if not isinstance(text, str):
        raise ContractError(f"task.environment: {broken(env, 'reset', text)}")
    return text


def checked_step(env: Any, value: Any) -> tuple[str, bool]:
    """What ``env.step`` returned, as ``(reply, done)``, or :class:`ContractError` when it is not
    a pair of a string and a bool (a bare string ``"42"`` would unpack as reply ``"4"``, done ``"2"``)."""
    pair = isinstance(value, tuple | list) and len(value) == 2
    if not (pair and isinstance(value[0], str) and _is_bool(value[1])):
        raise ContractError(f"task.environment: {broken(env, 'step', value)}")
    return value[0], bool(value[1])


def checked_reward(env: Any, value: Any) -> float:
    """What ``env.reward`` returned, as a float, or :class:`ContractError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ContractError(f"task.environment: {broken(env, 'reward', value)}")
    return float(value)


class Environment:
    """Base class of environments (subclassing it is optional: the loop reads the contract's
    methods; this gives the defaults of :attr:`stop`, :meth:`reset` and :meth:`error`)."""

    stop: tuple[str, ...] = ()

    def reset(self, problem: str) -> str:
        """The prompt text for ``problem`` (default: the problem as it is)."""
        return problem

    def step(self, turn: str) -> tuple[str, bool]:
        """The reply to ``turn`` and whether the sample ends."""
        raise NotImplementedError

    def error(self, message: str) -> str:
        """The reply for a step that failed with ``message``."""
        return f"error: {message}"


class ToolEnvironment(Environment):
    """Answers tool calls written ``<tag>argument</tag>`` (``tag``: each tool's, e.g. ``calc`` for
    the calculator) with ``reply_format`` around the tool's result (``<res>408</res>``); a turn
    ending at the end-of-sequence token is the answer.

    Args:
        tools: names registered in :data:`~rlinf_lightning.tools.TOOLS`, or :class:`Tool` objects.
        reply_format: the reply around the result; ``{}`` marks where it goes.
    """

    def __init__(self, tools: list[str | Tool], reply_format: str = "<res>{}</res>") -> None:
        self.tools = {t.call_tag: t for t in (TOOLS.get(t) if isinstance(t, str) else t for t in tools)}
        self.reply_format = reply_format
        self.stop = tuple(f"</{tag}>" for tag in self.tools)

    def step(self, turn: str) -> tuple[str, bool]:
        """Run the call that ends ``turn``; raises :class:`MalformedCall` when it has no opening tag
        (the argument is everything between the last opening tag and the closing one)."""
        tag = next((t for t in self.tools if turn.endswith(f"</{t}>")), None)
        if tag is None:
            raise MalformedCall(f"a call ends with one of {', '.join(self.stop)}")
        body = turn[: -len(f"</{tag}>")]
        start = body.rfind(f"<{tag}>")
        if start < 0:
            raise MalformedCall(f"</{tag}> without <{tag}>")
        return self.reply_format.format(self.tools[tag](body[start + len(tag) + 2 :])), False

    def error(self, message: str) -> str:
        return self.reply_format.format(f"error: {message}")
