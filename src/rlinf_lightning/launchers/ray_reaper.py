"""Ends the local Ray instance a driver started when that driver is killed.

``ray.init()`` without an address starts GCS, raylet and per-node agents as the driver's
children. On a normal exit Ray's ``atexit`` hook stops them; after SIGKILL (or the OOM killer) the
raylet and GCS fate-share with the driver, but the dashboard and runtime-env agents first try to
report to the dead GCS and linger for a minute or more. This watcher, started in its own session
so the driver's death does not take it along, polls the driver's pid and then kills the processes
it was given (identified by pid and start time, so a reused pid is never hit).

    python .../ray_reaper.py <driver_pid> <pid>:<create_time> ...
"""

from __future__ import annotations

import sys
import time


def reap(driver_pid: int, targets: list[tuple[int, float]], poll_s: float = 0.5) -> None:
    import psutil

    while psutil.pid_exists(driver_pid) and psutil.Process(driver_pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(poll_s)
    for pid, created in targets:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 1e-3:
                proc.kill()
        except psutil.Error:
            pass


def start_reaper(driver_pid: int) -> None:
    """Watch ``driver_pid`` and kill its Ray processes (its descendants now) when it dies."""
    import subprocess

    import psutil

    targets = [f"{p.pid}:{p.create_time()!r}" for p in psutil.Process(driver_pid).children(recursive=True)]
    subprocess.Popen(
        [sys.executable, __file__, str(driver_pid), *targets],  # by path: no package import
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


if __name__ == "__main__":
    pairs = [arg.split(":") for arg in sys.argv[2:]]
    reap(int(sys.argv[1]), [(int(pid), float(created)) for pid, created in pairs])
