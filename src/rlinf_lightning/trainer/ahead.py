"""AheadLaunch: a plan's workers started in a background thread while the current workers keep
training, so that switching to that plan waits only for what is left of their start-up (worker
processes import, build and set up their stages in seconds; iterations meanwhile go on)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class AheadLaunch:
    """Starts ``launch()`` (which returns a set-up runtime) in a thread at once.

    Attributes:
        layout: the plan's layout (``ExecutionPlan.layout()``): which switch may take these workers.
        launch_s: seconds from the start to the workers' set-up (once finished).
    """

    def __init__(self, launch: Callable[[], Any], layout: Any) -> None:
        self.layout, self.launch_s = layout, 0.0
        self.runtime: Any = None
        self.error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._stopper: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, args=(launch,), name="rlinf-ahead", daemon=True)
        self._thread.start()

    def _run(self, launch: Callable[[], Any]) -> None:
        try:
            self.runtime = launch()
        except BaseException as exc:  # raised where the workers are taken
            self.error = exc
        self.launch_s = time.perf_counter() - self._t0

    def ready(self) -> bool:
        """Whether the start-up has ended (set up, or failed: :meth:`take` then raises)."""
        return not self._thread.is_alive()

    def take(self) -> Any:
        """Wait for the workers' set-up; their runtime (raises what starting them raised)."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.runtime

    def discard(self) -> None:
        """Stop the workers once they are up, in another thread: nobody waits for their start."""

        def stop() -> None:
            self._thread.join()
            if self.runtime is not None:
                self.runtime.shutdown()

        self._stopper = threading.Thread(target=stop, name="rlinf-ahead-stop", daemon=True)
        self._stopper.start()

    def join(self) -> None:
        """Wait until discarded workers have stopped (no worker outlives the fit)."""
        if self._stopper is not None:
            self._stopper.join()
