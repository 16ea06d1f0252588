"""Strategy: turns (workflow, devices) into an ExecutionPlan. Registered under a string."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow


@dataclass
class Resources:
    """What the trainer was given: ``devices`` slots per node on ``num_nodes`` nodes."""

    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "cpu"

    @property
    def slots(self) -> list[int]:
        return list(range(self.devices * self.num_nodes))


class Strategy(ABC):
    name: str = "strategy"

    @abstractmethod
    def plan(self, workflow: Workflow, resources: Resources, micro_batch_size: int) -> ExecutionPlan:
        """Place every stage and size each channel's micro-batches (in samples)."""
