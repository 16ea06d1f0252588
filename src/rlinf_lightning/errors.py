"""Errors users see. Each names what is at fault (a config key, or a file and line) and the fix.

:class:`InputError` is every bad input a user can correct: ``rlinf fit`` prints its message as one
line (no traceback) and exits with status 2, as argument parsers do for bad arguments.
"""

from __future__ import annotations


class InputError(ValueError):
    """A bad input (config, data file, model directory, checkpoint); the message says which."""


class ConfigError(InputError):
    """One or more invalid config values, found before any model is loaded."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = [f"  {key}: {msg}" for key, msg in problems]
        super().__init__("invalid configuration:\n" + "\n".join(lines))

    @property
    def keys(self) -> list[str]:
        return [k for k, _ in self.problems]


class DataError(InputError):
    """A malformed dataset: the message names the file and, for a bad record, its 1-based line."""


class CheckpointError(InputError):
    """A checkpoint that is missing, partial or corrupt; the message names the file."""


class RunError(RuntimeError):
    """A run that failed on the way (not a bad input); the message says what and what survives."""


class NonFiniteError(RunError):
    """A stage met NaN or infinity where the run cannot go on (a loss or gradient norm too many
    steps in a row, advantages, rewards); the message names the stage, the iteration and what."""
