"""Child processes end with their parent.

Worker processes (``processes`` launcher) and train-engine ranks wait on command queues. If the
process that started them is killed (SIGKILL, the OOM killer), nothing would ever send them
``shutdown``: they would block forever, holding their memory. Each such child calls
:func:`exit_with_parent` first; a daemon thread then watches the process that started it (and its
own parent, which for a worker forked by a fork server is the server, ending with the driver) and
ends the child within a poll interval of the death, whatever the child is doing at the time.

(``prctl(PR_SET_PDEATHSIG)`` fires when the *thread* that started the child exits, which in a
threaded parent is not the parent's death; polling the pid has no such trap and works on macOS.)
"""

from __future__ import annotations

import os
import threading
import time

ORPHAN_EXIT_CODE = 3


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process (``os._exit``) soon after ``parent_pid`` ends, or after this process's own
    parent does (with a fork server, the server: it ends with ``parent_pid``)."""
    parent = os.getppid()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, someone else's
            return True
        return True

    def watch() -> None:
        while os.getppid() == parent and alive(parent_pid):
            time.sleep(poll_s)
        os._exit(ORPHAN_EXIT_CODE)  # no cleanup: the parent that owns our resources is gone

    threading.Thread(target=watch, name="rlinf-exit-with-parent", daemon=True).start()
