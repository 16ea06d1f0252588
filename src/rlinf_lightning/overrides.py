"""Dotted overrides of objects the argument parser keeps as plain values.

``--task.environment.init_args.fault=raise`` sets one argument of an object given as
``{class_path, init_args}``. jsonargparse applies such an override itself where the key is typed as
a class (``policy``, ``task``, ``trainer.algorithm``, ``task.critic``), but where the key is typed
loosely (``task.environment``: a dict; ``trainer.strategy``, ``trainer.launcher``,
``trainer.logger``: ``Any``) it stored the override beside the object (a dict key ``fault`` next to
``class_path``) or in place of it, and the run went on as if the option had never been given.

:func:`fold_object_overrides` folds every such override into one ``--KEY={class_path, init_args}``
argument, from the object as the rest of the command line and the config files resolve it, so the
override lands where it was meant to; :func:`unapplied_override` names any that still could not be
applied (the ``--trainer.strategy.retune_patience=5`` form, without ``init_args``), so it is refused
rather than dropped.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from jsonargparse import ArgumentError, ArgumentParser, Namespace

_INIT = ".init_args."


def _joined(argv: list[str]) -> list[str]:
    """``argv`` with ``--KEY.init_args.ARG VALUE`` written ``--KEY.init_args.ARG=VALUE``."""
    out, args = [], iter(argv)
    for arg in args:
        if arg.startswith("--") and "=" not in arg and _INIT in arg:
            arg = f"{arg}={next(args, '')}"
        out.append(arg)
    return out


def _lookup(ns: Any, dotted: str) -> Any:
    """The value at ``dotted`` (``task.environment``) in a parsed config, looking into an object's
    ``init_args`` where its key is not its own (``task`` -> ``task.init_args.environment``)."""
    for part in dotted.split("."):
        if isinstance(ns, Namespace):
            if part not in ns and "class_path" in ns and isinstance(ns.get("init_args"), Namespace):
                ns = ns["init_args"]
            ns = ns.get(part)
        elif isinstance(ns, dict):
            if part not in ns and isinstance(ns.get("init_args"), dict):
                ns = ns["init_args"]
            ns = ns.get(part)
        else:
            return None
    return ns


def _loose_object(parser: ArgumentParser, key: str, value: Any) -> dict | None:
    """``value`` as a ``{class_path, init_args}`` dict when it is an object the parser does not
    apply dotted overrides to (a dict, or an object of an ``Any``-typed key), else ``None``."""
    if isinstance(value, dict) and "class_path" in value:
        return dict(value)
    if isinstance(value, Namespace) and "class_path" in value:
        action = parser._option_string_actions.get(f"--{key}")
        if action is not None and getattr(action, "_typehint", None) is Any:
            return value.as_dict()
    return None


def _set(spec: dict, dotted: str, value: Any) -> None:
    init = spec.setdefault("init_args", {})
    *path, last = dotted.split(".")
    for part in path:
        init = init.setdefault(part, {})
    init[last] = value


def fold_object_overrides(parser: ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` (``rlinf <command> ...``) with the ``--KEY.init_args.ARG=VALUE`` overrides of each
    loosely typed object (see the module docstring) replaced by one ``--KEY={...}`` at the place
    of the last of them; others are left to the parser, as is everything when the command line
    does not parse without them (the parser then says why)."""
    argv = _joined(argv)
    found = [i for i, a in enumerate(argv) if a.startswith("--") and _INIT in a.split("=", 1)[0]]
    if not found or any(a in ("-h", "--help") for a in argv):
        return argv
    base = [a for i, a in enumerate(argv) if i not in found and not a.startswith("--print_config")]
    try:
        cfg = parser.parse_args(base)
    except (ArgumentError, SystemExit):
        return argv
    command = cfg.get("command")
    sub = parser._subcommands_action._name_parser_map.get(command) if parser._subcommands_action else None
    if sub is None:
        return argv
    folded: dict[str, dict] = {}
    last: dict[str, int] = {}  # where each object's folded override goes: at its last one
    for i in found:
        key, _, text = argv[i][2:].partition("=")
        obj, arg = key.rsplit(_INIT, 1)
        spec = folded.get(obj) or _loose_object(sub, obj, _lookup(cfg[command], obj))
        if spec is not None:
            _set(spec, arg, yaml.safe_load(text) if text else None)
            folded[obj], last[obj] = spec, i
    at = {i: obj for obj, i in last.items()}
    used = {i for i in found if argv[i][2:].partition("=")[0].rsplit(_INIT, 1)[0] in folded}
    return [
        f"--{at[i]}={json.dumps(folded[at[i]], default=str)}" if i in at else arg
        for i, arg in enumerate(argv)
        if i in at or i not in used
    ]


def unapplied_override(cfg: Any, prefix: str = "") -> str | None:
    """The first override the parser kept apart from its object (``--trainer.strategy.x=1`` on an
    ``Any``-typed key), as one line naming the key and the form that applies it."""
    from jsonargparse._util import NestedArg  # the parser's record of such an override

    if isinstance(cfg, NestedArg):
        obj = prefix.rstrip(".")
        return (
            f"--{obj}.{cfg.key.removeprefix('init_args.')}={cfg.val}: not applied to {obj}; give {obj} as "
            f"{{class_path, init_args}} (in the config or --{obj}={{...}}), then set its arguments as "
            f"--{obj}.init_args.ARG=VALUE"
        )
    items = cfg.items(branches=True) if isinstance(cfg, Namespace) else []
    for key, value in items:
        if isinstance(value, NestedArg | Namespace) and (
            problem := unapplied_override(value, f"{prefix}{key}.")
        ):
            return problem
    return None
