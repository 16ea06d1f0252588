"""Stage: one named step of a workflow.

A stage is built on the driver from configuration only (cheap, picklable) and comes alive on the
worker that hosts it: ``setup()`` builds its models there. It then sees micro-batches one at a time
through ``process`` and, when the iteration's last micro-batch has passed, ``end_iteration``.
``onload``/``offload`` bracket its turn on a shared device under a collocated plan (context
switching). A stage never learns which strategy, launcher or transport runs it.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict


class Stage:
    """Base class; subclasses override the hooks they need."""

    name: str = "stage"

    def setup(self, ctx: StageContext) -> None:
        """Build heavy state (models, engines) on the hosting worker."""

    def onload(self) -> None:
        """Bring this stage's state onto its device before its turn (collocated plans)."""

    def offload(self) -> None:
        """Release device memory after its turn so the next stage on the device has room."""

    def begin_iteration(self, iteration: int) -> None:
        """Called before the iteration's first micro-batch."""

    def process(self, batch: TensorDict) -> TensorDict | None:
        """Transform one micro-batch; the result goes to the stage's output channel."""
        return batch

    def end_iteration(self) -> dict[str, float]:
        """Called after the iteration's last micro-batch; returns metrics to log."""
        return {}

    def sync_state(self) -> TensorDict | None:
        """State this stage hands to its sync targets after ``end_iteration`` (e.g. new weights)."""
        return None

    def apply_sync(self, source: str, state: TensorDict) -> None:
        """Receive state that stage ``source`` handed over (e.g. load new weights)."""
        raise NotImplementedError(f"stage {self.name!r} does not accept sync state from {source!r}")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this stage exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""

    def teardown(self) -> None:
        """Release what ``setup`` started (processes, engines) when the run ends."""


class StageContext:
    """What a worker tells the stages it hosts about where they run."""

    def __init__(self, device: str = "cpu", rank: int = 0, world_size: int = 1, num_threads: int = 0):
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.num_threads = num_threads
