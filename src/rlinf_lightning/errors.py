"""Errors users see: each names the config key at fault and how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more invalid config values, found before any model is loaded."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = [f"  {key}: {msg}" for key, msg in problems]
        super().__init__("invalid configuration:\n" + "\n".join(lines))

    @property
    def keys(self) -> list[str]:
        return [k for k, _ in self.problems]
