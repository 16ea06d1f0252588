"""Cost curves: a profile from measurements taken on another cluster, so that ``rlinf plan`` can
rank plans for a cluster nobody has profiled with ``strategy: auto`` (``--profile curves.yaml``).

Each stage gives what was measured, in one or both forms::

    workflow: embodied       # optional: must be the config's workflow
    accelerator: cuda        # optional (default cpu): what one device is
    samples: 512             # the samples per iteration the ``devices`` seconds were measured at
                             # (default: the config's batch)
    message_s: 0.001         # optional: seconds a message between workers costs (default 0.0005)
    overhead_s: 0.0          # optional: seconds per iteration outside every stage
    stages:
      env: {call_s: {16: 0.021, 64: 0.052, 256: 0.17}}      # one call's seconds at that many samples (envs)
      rollout: {call_s: {16: 0.004, 256: 0.02}}
      advantage: {call_s: {256: 0.001}}
      actor: {devices: {1: 40.0, 8: 5.9, 32: 1.8}, end_s: 0.2}   # seconds per iteration on d devices

- ``call_s`` is fitted as ``a + b x samples`` (``StageCost.fit``), as auto fits its own calls.
- ``devices`` are the stage's seconds per iteration with the batch spread over ``d`` data-parallel
  devices (one device per replica). Without ``call_s``, a call costs what the fewest devices spent
  per sample (``seconds x d / samples``, proportional); either way the curve sets how much more a
  call costs in a group of ``d`` replicas than perfect scaling from the fewest devices would
  (``Profile.replica_cost``; 1 there), interpolated between counts and extrapolated past them.
- ``end_s``, ``sync_s``: the stage's end-of-iteration (optimizer step) and sync seconds.

Every stage of the workflow needs a curve: a stage left out would be simulated as free.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.auto.profile import Profile, StageCost

TOP_KEYS = ("workflow", "accelerator", "samples", "message_s", "overhead_s", "stages")
STAGE_KEYS = ("call_s", "devices", "end_s", "sync_s")


def is_curves(path: str | Path) -> bool:
    """Whether the file at ``path`` reads as cost curves rather than a profile auto saved."""
    try:
        d = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(d, dict) and "stages" in d and "version" not in d


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: expected seconds (a number >= 0), got {value!r}")
    return float(value)


def _curve(value: Any, where: str, what: str, least: int = 1) -> dict[int, float]:
    """``{count: seconds}`` with positive integer counts."""
    if not isinstance(value, dict) or len(value) < least:
        raise ValueError(f"{where}: expected {{{what}: seconds}} ({least} or more), got {value!r}")
    out = {}
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}: {what} must be integers >= 1, got {k!r}")
        out[k] = _seconds(v, f"{where}.{k}")
    return out


def profile_from_curves(d: Any, workflow: Workflow, samples: int, source: str = "curves") -> Profile:
    """A :class:`Profile` of ``workflow`` from cost curves (the module docstring's format);
    ``ValueError`` naming the key for anything else. ``samples``: the config's batch."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a mapping with 'stages', got {type(d).__name__}")
    if unknown := sorted(set(d) - set(TOP_KEYS)):
        raise ValueError(f"{source}: unknown keys {unknown}; expected some of {list(TOP_KEYS)}")
    if d.get("workflow", workflow.name) != workflow.name:
        raise ValueError(f"{source}: workflow {d['workflow']!r}; this config's is {workflow.name!r}")
    measured_at = d.get("samples", samples)
    if isinstance(measured_at, bool) or not isinstance(measured_at, int) or measured_at < 1:
        raise ValueError(f"{source}: samples must be an integer >= 1, got {measured_at!r}")
    stages = d.get("stages")
    if not isinstance(stages, dict):
        raise ValueError(f"{source}: stages must map each stage to its curves, got {stages!r}")
    if unknown := sorted(set(stages) - set(workflow.stages)):
        raise ValueError(f"{source}: stages {unknown} not in workflow {workflow.name!r}: {workflow.order}")
    if missing := [s for s in workflow.order if s not in stages]:
        raise ValueError(f"{source}: stages {missing} have no curve (one left out would cost nothing)")
    prof = Profile(workflow.name, accelerator=str(d.get("accelerator", "cpu")))
    for key in ("message_s", "overhead_s"):
        if key in d:
            setattr(prof, key, _seconds(d[key], f"{source}: {key}"))
    for name, spec in stages.items():
        where = f"{source}: stages.{name}"
        if not isinstance(spec, dict) or not spec or (unknown := sorted(set(spec) - set(STAGE_KEYS))):
            raise ValueError(f"{where}: expected some of {list(STAGE_KEYS)}, got {spec!r}")
        if "call_s" not in spec and "devices" not in spec:
            raise ValueError(f"{where}: needs call_s (seconds per call at sample counts) or devices")
        end = _seconds(spec.get("end_s", 0.0), f"{where}.end_s")
        if "sync_s" in spec:
            prof.sync_s[name] = _seconds(spec["sync_s"], f"{where}.sync_s")
        devices = _curve(spec["devices"], f"{where}.devices", "device counts") if "devices" in spec else {}
        if "call_s" in spec:
            calls = _curve(spec["call_s"], f"{where}.call_s", "sample counts")
            prof.stages[name] = StageCost.fit(sorted(calls.items()), end)
        else:
            d0 = min(devices)
            prof.stages[name] = StageCost(0.0, devices[d0] * d0 / measured_at, end, [])
        if devices:
            d0 = min(devices)
            base = devices[d0] * d0
            if base <= 0:
                raise ValueError(f"{where}.devices.{d0}: the fewest devices' seconds must be > 0")
            prof.replica_cost[name] = {str(n): t * n / base for n, t in devices.items()}
    return prof


def load_curves(path: str | Path, workflow: Workflow, samples: int) -> Profile:
    """:func:`profile_from_curves` of a YAML (or JSON) file; one-line ``ValueError`` otherwise."""
    try:
        d = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{path}: not readable cost curves ({type(exc).__name__}: {first})") from None
    return profile_from_curves(d, workflow, samples, str(path))


def extrapolated(profile: Profile, replicas: int) -> list[str]:
    """Stages whose device curve stops short of ``replicas`` (their cost there is extrapolated)."""
    return [s for s, c in profile.replica_cost.items() if max(int(n) for n in c) < replicas]
