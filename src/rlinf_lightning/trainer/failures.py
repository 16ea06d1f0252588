"""How a run that a stage ended is reported: one line on the terminal, the traceback in the run's
log file (``<default_root_dir>/run.log``).

A stage ends a run on purpose (a :class:`~rlinf_lightning.errors.RunError` such as the non-finite
guard's) or runs out of memory (``torch.OutOfMemoryError`` on a GPU, ``MemoryError`` on the host);
the worker marks either in its :class:`~rlinf_lightning.flow.worker.StageError`. The driver, which
holds the plan, completes the line: for out of memory the budget in force, the keys that lower it
and what the plan's memory check predicted for that stage on that worker; for both, which
checkpoint is left to resume from. Any other stage error keeps its traceback on the terminal: it
is a bug to report, not a setting to change.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rlinf_lightning.checkpoint import LAST
from rlinf_lightning.flow.memory import gib, stage_micro_batch, worker_memory
from rlinf_lightning.flow.worker import StageError

PACKAGE = "rlinf_lightning"


class RunLog:
    """``<root>/run.log``: every record of the package's loggers while the run lasts (INFO and
    above, as the terminal shows them, with times) and the tracebacks the terminal is spared."""

    def __init__(self, root: Path) -> None:
        self.path = root / "run.log"
        self.handler = logging.FileHandler(self.path, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.handler.setLevel(logging.INFO)
        logging.getLogger(PACKAGE).addHandler(self.handler)

    def failure(self, line: str, tb: str) -> None:
        """Append the line that ended the run and the traceback behind it."""
        self.handler.flush()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR {line}\n{tb.rstrip()}\n")

    def close(self) -> None:
        logging.getLogger(PACKAGE).removeHandler(self.handler)
        self.handler.close()


def failure_line(exc: StageError, workflow: Any, plan: Any, ckpt_dir: Path, log_path: Path) -> str | None:
    """The one line for a stage that stopped the run or ran out of memory; ``None`` for any
    other error (its traceback is the report)."""
    if exc.line is None:
        return None
    line = exc.line
    if exc.kind == "out_of_memory":
        line += f"; {memory_context(exc, workflow, plan)}"
    return f"{line}; {checkpoint_left(ckpt_dir)}; traceback in {log_path}"


def memory_context(exc: StageError, workflow: Any, plan: Any) -> str:
    """The stage's budget in force, the keys that lower it, and the plan's estimate for it."""
    stage = workflow.stages[exc.stage]
    budget, keys = stage.budget(stage_micro_batch(workflow, plan, exc.stage))
    workers = [w for w in worker_memory(workflow, plan) if exc.stage in w.parts or exc.stage in w.unknown]
    mine = [w for w in workers if w.group.worker_name(w.replica) == exc.worker] or workers
    if not mine or exc.stage in mine[0].unknown:
        predicted = "the plan's memory check had no estimate for it"
    else:
        w = mine[0]
        predicted = (
            f"the plan's memory check predicted {_size(w.stage_bytes(exc.stage))} for it on {w.device} "
            f"({_size(w.nbytes)} for the worker; a floor: activations are not counted)"
        )
    return f"{budget} in force (lower {', '.join(keys)}); {predicted}"


def _size(nbytes: int) -> str:
    """``"45.1 GiB"``, ``"3.2 MiB"`` or ``"12 KiB"``: a small model's estimate is not ``0.0 GiB``."""
    if nbytes >= 2**30:
        return gib(nbytes)
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def checkpoint_left(ckpt_dir: Path) -> str:
    """Which checkpoint a resume would start from."""
    pointer = ckpt_dir / LAST
    if not pointer.is_file():
        return "no checkpoint was written yet"
    return f"the last checkpoint, {ckpt_dir / pointer.read_text().strip()}, is intact (--ckpt_path last)"
