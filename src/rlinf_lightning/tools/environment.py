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

from rlinf_lightning.tools.tool import TOOLS, MalformedCall, Tool


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
