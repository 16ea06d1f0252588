"""Multi-turn rollouts with tools: the :class:`Tool` registry and its built-in ``calculator``,
the :class:`Environment` contract, and the :class:`TurnLoop` that runs them above a rollout engine
(``docs/tools.md``)."""

from rlinf_lightning.tools.calculator import CALCULATOR, calculate
from rlinf_lightning.tools.environment import Environment, ToolEnvironment
from rlinf_lightning.tools.loop import TurnLoop, environment_factory, final_turn
from rlinf_lightning.tools.tool import TOOLS, MalformedCall, Tool

__all__ = [
    "CALCULATOR",
    "TOOLS",
    "Environment",
    "MalformedCall",
    "Tool",
    "ToolEnvironment",
    "TurnLoop",
    "calculate",
    "environment_factory",
    "final_turn",
]
