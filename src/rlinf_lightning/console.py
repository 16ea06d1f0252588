"""Where the library's messages go: ``logging`` records, routed to the terminal by :func:`install`.

Every module logs through its own ``log = logging.getLogger(__name__)``, so every record comes from
a logger under ``rlinf_lightning`` and one call here decides where they all go. :func:`install`
puts two handlers on that package logger: DEBUG and INFO records (the plan, "resumed from ...",
the held-out result) go to **stdout**, the run's report that users pipe and tests read; WARNING and
above go to **stderr**. On a terminal rich's ``RichHandler`` draws them (time, level, colour);
elsewhere (a pipe, a file, CI) each record is one plain line, so output can be grepped and never
wraps.

Who calls it: ``rlinf`` with the level of ``--quiet`` (WARNING) or ``--verbose`` (DEBUG), INFO
otherwise; and ``import rlinf_lightning``, which sets the package logger to INFO as Lightning does
and installs the handlers when the application has configured no logging (the root logger has no
handler), so a script's ``RLTrainer.fit`` shows its plan and results. An application that
configures ``logging`` before the import gets no handler from us: the records propagate to its own.

The per-iteration progress line is not a record but a console product of
:class:`~rlinf_lightning.callbacks.ProgressBar`; it shows when the package logger is enabled for
INFO, so ``--quiet`` (or ``logging.getLogger("rlinf_lightning").setLevel(logging.WARNING)``)
hides it too.
"""

from __future__ import annotations

import logging
import sys

PACKAGE = "rlinf_lightning"

_installed: list[logging.Handler] = []  # this module's handlers on the package logger


class _PlainHandler(logging.Handler):
    """One line per record on ``sys.stdout`` / ``sys.stderr`` as they are when the record is written
    (pytest and notebooks replace them after the handler exists), flushed at once so a reader of a
    pipe sees each event when it happens."""

    def __init__(self, stream: str, fmt: str) -> None:
        super().__init__()
        self.stream = stream
        self.setFormatter(logging.Formatter(fmt))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = getattr(sys, self.stream)
            out.write(self.format(record) + "\n")
            out.flush()
        except Exception:  # noqa: BLE001 (logging's own convention: report, never raise)
            self.handleError(record)


def _handler(stream: str, fmt: str) -> logging.Handler:
    if getattr(sys, stream).isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        return RichHandler(console=Console(stderr=stream == "stderr"), show_path=False, markup=False)
    return _PlainHandler(stream, fmt)


def install(level: int = logging.INFO) -> None:
    """Route every ``rlinf_lightning`` record at ``level`` or above to the terminal (INFO and DEBUG
    to stdout, warnings and errors to stderr), replacing the handlers an earlier call installed.
    The records no longer propagate to the root logger, so they are never written twice."""
    logger = logging.getLogger(PACKAGE)
    for h in _installed:
        logger.removeHandler(h)
    report = _handler("stdout", "%(message)s")
    report.addFilter(lambda record: record.levelno < logging.WARNING)
    problems = _handler("stderr", "%(levelname)s: %(message)s")
    problems.setLevel(logging.WARNING)
    _installed[:] = [report, problems]
    for h in _installed:
        logger.addHandler(h)
    logger.setLevel(level)
    logger.propagate = False
