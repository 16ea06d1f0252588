"""What starting a plan's worker processes costs, before any has started on this run.

Auto weighs a faster plan's seconds per iteration against what its workers take to start. Once a
worker process has started on the run that is measured; until then it is estimated from this
process: a new worker repeats the interpreter's start-up and imports, and the stages' set-up.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started (Linux; ``None`` elsewhere): the interpreter, its
    imports and whatever ran before the fit, the most a new worker process repeats."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def launch_estimate(inprocess_s: float, startup_s: float | None) -> float:
    """What starting worker processes will cost, before any started on this run: a process
    repeats the driver's start-up (``startup_s``, its age when the fit began: interpreter and
    imports, an upper bound since it also counts the script's own work) and the stages' set-up
    (``inprocess_s``, measured in this process). Without ``startup_s``, the set-up alone."""
    return (startup_s or 0.0) + inprocess_s
