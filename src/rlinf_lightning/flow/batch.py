"""BatchShape: how many samples an iteration has and what the indivisible unit of a micro-batch
is. A task states it; a strategy cuts it into micro-batches (the plan's granularity)."""

from __future__ import annotations

from dataclasses import dataclass


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
