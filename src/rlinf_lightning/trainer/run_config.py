"""What a run was: its resolved configuration, recorded so that runs do not collide.

:func:`resolved_config` describes the trainer, policy and task as LightningCLI's config does (a
section per object, ``class_path`` and ``init_args`` for each object, the algorithm resolved from
its name to its options), from the objects themselves, so a run started from Python and one
started from the command line record the same thing. A run writes it to
``<default_root_dir>/config.yaml``, into ``summary.json`` and into every checkpoint's
``state.json``. Before any worker starts, the run compares it with the checkpoint it would resume
or overwrite (:func:`update_differences`): what changes the update (the algorithm and its
options, ``trainer.max_staleness``, the policy's and the task's settings) must match; what only
changes where, how fast or how finely it runs (strategy, devices, engine, precision, micro-batch
sizes, evaluation, the rollout engine; :data:`FREE_KEYS`) may change. ``trainer.allow_config_change``
lets a run go on regardless.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

from rlinf_lightning.checkpoint import LAST

#: trainer settings that change the update; the others (plan, devices, cadences, loggers) do not
TRAINER_UPDATE_KEYS = ("algorithm", "max_staleness")
#: settings of the policy or task that change how, not what, the update computes: free to change
#: between a checkpoint and the run resuming it (``policy.model_path``: the checkpoint holds the
#: weights, checked against the policy on their own)
FREE_KEYS = frozenset(
    {
        "model_path",
        "gradient_checkpointing",
        "test_path",
        "eval_size",
        "eval_episodes",
        "eval_metric",
        "rollout",
        "rollout_engine_options",
        "train_micro_batch_size",
        "train_max_tokens_per_micro_batch",
        "inference_max_tokens_per_micro_batch",
    }
)
_DEPTH = 4  # nesting beyond this is described by its type only


def resolved_config(trainer: Any, policy: Any, task: Any) -> dict[str, Any]:
    """``{"trainer": {...}, "policy": {class_path, init_args}, "task": {...}}``, JSON-able. The
    trainer's objects other than the algorithm and the strategy (loggers, callbacks) are recorded
    by class only: reading their attributes could start them (a wandb run)."""
    from rlinf_lightning.algorithms import ALGORITHMS

    settings = {k: _value(v, 1 if k == "strategy" else _DEPTH) for k, v in _arguments(trainer).items()}
    settings["algorithm"] = _value(ALGORITHMS.resolve(trainer.algorithm), 1)
    return {"trainer": settings, "policy": _value(policy, 0), "task": _value(task, 0)}


def _class_path(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _arguments(obj: Any) -> dict[str, Any]:
    """The object's constructor arguments, read back from its attributes of the same names."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    out = {}
    try:
        params = inspect.signature(type(obj).__init__).parameters
    except (TypeError, ValueError):  # a builtin's: nothing to read back
        return out
    for name, p in params.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        try:
            out[name] = getattr(obj, name)
        except Exception:  # noqa: BLE001 (a property that cannot answer here: not recorded)
            continue
    return out


def _value(v: Any, depth: int) -> Any:
    if isinstance(v, str | int | float | bool | type(None)):
        return v
    if hasattr(v, "as_posix"):  # a path
        return str(v)
    if isinstance(v, list | tuple):
        return [_value(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): _value(x, depth + 1) for k, x in v.items()}
    if depth >= _DEPTH or isinstance(v, type):
        return f"<{_class_path(v) if not isinstance(v, type) else v.__qualname__}>"
    args = {k: _value(x, depth + 1) for k, x in _arguments(v).items()}
    return {"class_path": _class_path(v), "init_args": args}


def update_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for each setting that changes the update and
    differs (see the module docstring). A changed class is one difference, named by the key of
    the object (``trainer.algorithm``: ``GRPO`` there, ``DAPO`` here), not by its options."""
    out: list[tuple[str, Any, Any]] = []
    for key in TRAINER_UPDATE_KEYS:
        _diff(f"trainer.{key}", saved.get("trainer", {}).get(key), current["trainer"].get(key), out)
    for section in ("policy", "task"):
        _diff(section, saved.get(section), current[section], out)
    return out


def _diff(key: str, a: Any, b: Any, out: list[tuple[str, Any, Any]]) -> None:
    if key.rsplit(".", 1)[-1] in FREE_KEYS or a == b:
        return
    if _is_object(a) and _is_object(b):
        if a["class_path"] != b["class_path"]:
            out.append((key, _short(a), _short(b)))
            return
        a, b = a["init_args"], b["init_args"]
    if isinstance(a, dict) and isinstance(b, dict):
        for k in dict.fromkeys([*a, *b]):
            _diff(f"{key}.{k}", a.get(k), b.get(k), out)
        return
    out.append((key, _short(a), _short(b)))


def _is_object(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == {"class_path", "init_args"}


def _short(v: Any) -> str:
    """A value for a one-line message: an object by its class name."""
    if _is_object(v):
        return v["class_path"].rsplit(".", 1)[-1]
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def differences_text(diffs: list[tuple[str, Any, Any]]) -> str:
    """``"trainer.algorithm (GRPO there, DAPO here), task.group_size (8 there, 4 here)"``."""
    return ", ".join(f"{k} ({a} there, {b} here)" for k, a, b in diffs)


def algorithm_text(algorithm: Any) -> str:
    """``"DAPO (clip_eps_high=0.28, ...)"``: the class and the options that differ from its
    defaults (``"GRPO (defaults)"`` when none do)."""
    name = type(algorithm).__name__
    if not dataclasses.is_dataclass(algorithm):
        return name
    changed = [
        f"{f.name}={getattr(algorithm, f.name)!r}"
        for f in dataclasses.fields(algorithm)
        if f.init and f.default is not dataclasses.MISSING and getattr(algorithm, f.name) != f.default
    ]
    return f"{name} ({', '.join(changed) if changed else 'defaults'})"


def collision(ckpt_dir: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """``("trainer.default_root_dir", problem)`` when a run, new or resuming (from a checkpoint
    anywhere), would write into a directory whose newest checkpoint a run of another configuration
    wrote (one that changes the update; a checkpoint that recorded none, from an older version, is
    not judged)."""
    pointer = ckpt_dir / LAST
    if not pointer.is_file():
        return None
    path = ckpt_dir / pointer.read_text().strip()
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if "config" not in state or not (diffs := update_differences(state["config"], config)):
        return None
    root = ckpt_dir.parent
    return (
        "trainer.default_root_dir",
        f"{root} holds the checkpoints of another run (up to iteration {state.get('iteration')}), which "
        f"differs on {differences_text(diffs)}; write this run elsewhere "
        f"(--trainer.default_root_dir={root}_2), resume that one with its own config and --ckpt_path last, "
        "or set trainer.allow_config_change=true to replace it",
    )


def resume_mismatch(path: Path, saved: dict[str, Any] | None, config: dict[str, Any]) -> str | None:
    """Why the checkpoint at ``path``, written under ``saved``, must not be resumed under
    ``config``, or ``None``."""
    if saved is None or not (diffs := update_differences(saved, config)):
        return None
    return (
        f"{path}: written by a run with another configuration: {differences_text(diffs)}; resume it "
        "with the config that wrote it (its run directory's config.yaml), or set "
        "trainer.allow_config_change=true to go on under this one"
    )
