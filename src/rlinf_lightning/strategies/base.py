"""Strategy: turns (workflow, resources, batch shape) into an ExecutionPlan. Registered by name."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlinf_lightning.flow.plan import ExecutionPlan, Schedule, WorkerGroup
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
class BatchShape:
    """Samples per iteration, samples per prompt group, and the requested micro-batch (or None)."""

    rollout_batch_size: int
    group_size: int
    micro_batch_size: int | None = None

    def micro_batch_for(self, parts: int) -> int:
        """The requested micro-batch, or the largest one of whole groups that cuts the batch into
        at least ``parts`` equal pieces."""
        if self.micro_batch_size:
            return self.micro_batch_size
        groups = self.rollout_batch_size // self.group_size
        for per in range(max(1, groups // parts), 0, -1):
            if groups % per == 0:
                return per * self.group_size
        return self.group_size


class Strategy(ABC):
    name: str = "strategy"

    @abstractmethod
    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        """Place every stage and size each channel's micro-batches (in samples)."""

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
