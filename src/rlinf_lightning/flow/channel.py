"""Channel: a FIFO of micro-batches between two stages.

The transport is chosen from the plan (adaptive communication): stages on the same worker pass
objects through an in-process queue. Every ``get`` has a timeout, so a stalled producer becomes a
clear error, never a hang.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any


class ChannelTimeout(TimeoutError):
    pass


class ChannelAborted(RuntimeError):
    """Raised in a waiting stage when another part of the run failed."""


class EndOfIteration:
    """Marker a stage forwards after the last micro-batch of an iteration."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def __repr__(self) -> str:
        return f"EndOfIteration({self.iteration})"


class Channel:
    """In-process FIFO; the base of every transport."""

    def __init__(self, name: str, timeout_s: float = 600.0, abort: threading.Event | None = None) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.abort = abort or threading.Event()
        self._q: queue.Queue = queue.Queue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        """Next item; waits at most ``timeout`` (default: the channel's) and stops early on abort."""
        t = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        while True:
            try:
                return self._q.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.abort.is_set():
                    raise ChannelAborted(f"channel {self.name!r}: run aborted") from None
                if time.monotonic() >= deadline:
                    raise ChannelTimeout(f"channel {self.name!r}: nothing arrived within {t:.0f} s") from None

    def poll(self) -> tuple[bool, Any]:
        """``(True, item)`` if an item is waiting, else ``(False, None)``, without blocking."""
        try:
            return True, self._q.get_nowait()
        except queue.Empty:
            return False, None

    def empty(self) -> bool:
        return self._q.empty()
