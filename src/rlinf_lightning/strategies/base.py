"""Strategy: turns (workflow, resources, batch shape) into an ExecutionPlan. Registered by name."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow


@dataclass
class Resources:
    """What the trainer was given: ``devices`` slots per node on ``num_nodes`` nodes.

    On GPU a slot is a GPU; on CPU it is a worker process with ``threads_per_slot`` torch threads
    (0: the machine's cores shared evenly between the slots).
    """

    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "cpu"
    threads_per_slot: int = 0

    @property
    def slots(self) -> list[int]:
        return list(range(self.devices * self.num_nodes))

    def threads(self, n_slots: int) -> int:
        """Torch threads for a worker spanning ``n_slots`` slots (CPU)."""
        per = self.threads_per_slot or max(1, (os.cpu_count() or 1) // len(self.slots))
        return per * n_slots


@dataclass
class BatchShape:
    """Samples per iteration, samples per prompt group, and the requested micro-batch (or None)."""

    rollout_batch_size: int
    group_size: int
    micro_batch_size: int | None = None

    def split(self, parts: int) -> int:
        """The largest micro-batch of whole groups that divides the batch into >= ``parts`` pieces."""
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
