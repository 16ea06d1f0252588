"""Launcher and Runtime: who starts the workers of a plan, and the handle to drive them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tensordict import TensorDict

from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.worker import Span
from rlinf_lightning.flow.workflow import Workflow


class Runtime(ABC):
    """A launched plan: feed it an iteration's micro-batches, call stage methods, shut it down."""

    @abstractmethod
    def run_iteration(self, iteration: int, batches: list[TensorDict]) -> dict[str, dict[str, float]]:
        """Stream ``batches`` through the workflow; returns per-stage metrics once every stage ended."""

    @abstractmethod
    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on ``stage`` where it lives (evaluation, checkpoint state)."""

    @abstractmethod
    def pop_spans(self) -> list[Span]:
        """Spans recorded since the last call, from every worker."""

    def shutdown(self) -> None:
        """Stop the workers; safe to call twice."""


class Launcher(ABC):
    @abstractmethod
    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime: ...
