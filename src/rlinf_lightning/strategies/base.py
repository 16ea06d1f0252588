"""Strategy: turns (workflow, resources, batch shape) into an ExecutionPlan. Registered by name."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.plan import ExecutionPlan, Schedule, WorkerGroup
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.workflow import Workflow


@dataclass
class Resources:
    """What the trainer was given: ``devices`` slots per node on ``num_nodes`` nodes.

    A slot is a GPU when ``accelerator`` is ``cuda``; on ``cpu`` it is a share of the cores:
    ``threads_per_slot`` torch threads (0: the machine's cores shared evenly between the slots).
    """

    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "cpu"
    threads_per_slot: int = 0

    @property
    def slots(self) -> list[int]:
        return list(range(self.devices * self.num_nodes))

    def threads(self, n_slots: int) -> int:
        """Torch threads for a replica spanning ``n_slots`` slots."""
        per = self.threads_per_slot or max(1, (os.cpu_count() or 1) // min(len(self.slots), self.devices))
        return per * n_slots


@dataclass
class RunInfo:
    """What a strategy learns once the workers run: where the run writes, how long it is, how
    long starting the workers took (what a change of placement would cost again), and whether
    ``trainer.launcher`` starts each worker as a process of its own (``separate_processes``;
    a plan may name another launcher: :attr:`ExecutionPlan.launcher`), and whether it can start
    them in the background (``background_start``: :meth:`Strategy.ahead` is followed)."""

    run_dir: Path
    max_iterations: int
    launch_s: float
    separate_processes: bool = False
    background_start: bool = False


@dataclass
class Replan:
    """A strategy's request to run the next iterations under ``plan`` (``reason`` is logged).
    The same groups with other micro-batch sizes take effect at once; other groups restart the
    workers, carrying the training state over."""

    plan: ExecutionPlan
    reason: str


class Strategy(ABC):
    """Turns a workflow into a plan. A fixed strategy only implements :meth:`plan`; an adaptive
    one also watches the run (:meth:`observe`) and may ask for another plan between iterations.

    Attributes:
        metrics: what the strategy reports with each iteration's metrics (e.g. predicted seconds).
    """

    name: str = "strategy"
    metrics: dict[str, float] = {}

    @abstractmethod
    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        """Place every stage and size each channel's micro-batches (in samples)."""

    def on_launch(self, info: RunInfo) -> None:
        """The workers of the first plan are running."""

    def on_relaunch(self, info: RunInfo) -> None:
        """The workers of a plan returned by :meth:`observe` are running; ``info.launch_s`` is
        what the switch took (saving and loading the training state included)."""

    def holds_after(self, iteration: int) -> bool:
        """Whether the workers must be idle after ``iteration`` (not start the next one early),
        so that a new plan can take over right after it."""
        return False

    def ahead(self) -> ExecutionPlan | None:
        """A plan whose workers should be starting now, in the background, while the current ones
        keep training: a later :class:`Replan` to its layout takes them over instead of starting
        its own (asked after each iteration; ``None``, or another plan, stops those started)."""
        return None

    def observe(
        self,
        iteration: int,
        seconds: float,
        spans: list[Span],
        micro_batch: int,
        queued: bool,
        ahead_ready: bool = False,
    ) -> Replan | None:
        """Iteration ``iteration`` took ``seconds`` at ``micro_batch`` samples per input message;
        ``spans`` are its stage calls; ``queued``: the next iteration already started (so only
        the micro-batch size can change before the one after); ``ahead_ready``: the workers
        started for :meth:`ahead` are up (a switch to them waits for nothing). Returns a new plan
        or ``None``."""
        return None

    @staticmethod
    def group(
        name: str,
        stages: list[str],
        slots: list[int],
        resources: Resources,
        schedule: Schedule,
        slots_per_replica: int = 1,
        context_switch: bool = False,
    ) -> WorkerGroup:
        return WorkerGroup(
            name,
            stages,
            slots,
            slots_per_replica,
            schedule,
            context_switch,
            resources.threads(slots_per_replica),
        )

    def make_plan(
        self,
        workflow: Workflow,
        resources: Resources,
        groups: list[WorkerGroup],
        micro_batch: int,
        notes: str,
    ) -> ExecutionPlan:
        """The plan with ``micro_batch`` samples per message on every stream channel."""
        mbs = {e.channel: micro_batch for e in workflow.edges_of("stream")}
        return ExecutionPlan(self.name, groups, mbs, resources.devices, resources.accelerator, notes)
