"""Name -> object registries that built-ins and plugins share.

Lightning resolves ``strategy="ddp"`` through ``StrategyRegistry`` without the trainer branching on
names; every pluggable concept here (strategies, launchers, rollout engines, train engines,
algorithms, rewards) does the same through one :class:`Registry` each. Third-party packages add
entries from the ``rlinf_lightning.plugins`` entry-point group: each entry point names a callable
that is called once, with no arguments, and registers whatever it brings.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

PLUGIN_GROUP = "rlinf_lightning.plugins"
_plugins_loaded = False
_plugin_errors: dict[str, str] = {}


class Registry(Generic[T]):
    """A named collection of factories (classes or functions) of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._descriptions: dict[str, str] = {}
        self._origins: dict[str, str] = {}

    def register(self, name: str, obj: T | None = None, *, description: str = "", origin: str = "built-in"):
        """Register ``obj`` under ``name``; usable as a decorator when ``obj`` is omitted."""

        def _add(target: T) -> T:
            if name in self._entries and self._entries[name] is not target:
                raise ValueError(f"{self.kind} {name!r} is already registered by {self._origins[name]}")
            self._entries[name] = target
            doc = (getattr(target, "__doc__", None) or "").strip().splitlines()
            self._descriptions[name] = description or (doc[0] if doc else "")
            self._origins[name] = origin
            return target

        return _add if obj is None else _add(obj)

    def get(self, name: str) -> T:
        load_plugins()
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        load_plugins()
        close = difflib.get_close_matches(name, list(self._entries), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries))}.{hint}"

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return iter(sorted(self._entries))

    def describe(self) -> list[tuple[str, str, str]]:
        """(name, origin, one-line description) rows, sorted by name."""
        return [(n, self._origins[n], self._descriptions[n]) for n in self]

    def resolve(self, spec: str | Any, *args: Any, **kwargs: Any) -> Any:
        """Instantiate a registered factory by name, build a ``{class_path, init_args}`` dict, or
        return an already-built object unchanged."""
        if isinstance(spec, str):
            return self.get(spec)(*args, **kwargs)
        return instantiate(spec)


def instantiate(spec: Any) -> Any:
    """Build ``{class_path, init_args}`` dicts (jsonargparse style); return other objects unchanged."""
    if isinstance(spec, dict) and "class_path" in spec:
        module, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(**spec.get("init_args", {}))
    return spec


def load_plugins() -> None:
    """Import every installed plugin once (entry-point group ``rlinf_lightning.plugins``)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            hook: Callable[[], None] = ep.load()
            hook()
        except Exception as exc:  # a broken plugin must not break the core; `rlinf plugins` shows it
            _plugin_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "plugin %s failed to load (%s); its components are missing (rlinf plugins lists what loaded)",
                ep.name,
                _plugin_errors[ep.name],
            )


def plugin_errors() -> dict[str, str]:
    load_plugins()
    return dict(_plugin_errors)


def installed_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, distribution name, its version) of each installed plugin."""
    rows = []
    for ep in entry_points(group=PLUGIN_GROUP):
        dist = getattr(ep, "dist", None)
        rows.append((ep.name, dist.name if dist else "?", dist.version if dist else "?"))
    return rows
