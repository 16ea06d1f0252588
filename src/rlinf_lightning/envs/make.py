"""Making an env by name: a registered factory (``ENVS``, plugins add theirs) or else a gymnasium id."""

from __future__ import annotations

from functools import partial
from typing import Any

from rlinf_lightning.envs.base import ENVS, EnvBatch
from rlinf_lightning.envs.gym import GymEnvBatch, ensure_registered
from rlinf_lightning.envs.time_aware import TimeAware


def make_env(name: str, num_envs: int, time_aware: bool = False, **kwargs: Any) -> EnvBatch:
    """The registered env ``name`` (a factory called with ``num_envs`` and ``kwargs``), or else
    the gymnasium id ``name`` as a synchronous vector env; ``time_aware``: wrapped in
    :class:`~rlinf_lightning.envs.time_aware.TimeAware` (``obs["time"]``, the time limit terminal)."""
    factory = ENVS.get(name) if name in ENVS else partial(GymEnvBatch, name)
    env = factory(num_envs=num_envs, **kwargs)
    return TimeAware(env) if time_aware else env


def import_env(name: str, **kwargs: Any) -> None:
    """Pay what the first env of the gymnasium id ``name`` costs a process (importing and
    registering gymnasium-robotics, about 0.4 s; MuJoCo's first model, 0.1 s) by making one and
    closing it, so that a stage pays it in its set-up rather than in its first step (where, on
    workers started in the background, it would stall the first iteration after the switch). A
    registered factory's env is not made: it may be costly (a GPU simulator's scene)."""
    if name not in ENVS:
        make_env(name, 1, **kwargs).close()


def check_env(name: str) -> str | None:
    """Why ``name`` names no env (neither registered nor a gymnasium id), or ``None``; makes none."""
    if name in ENVS:
        return None
    try:
        ensure_registered(name)
    except (KeyError, ImportError) as exc:
        return str(exc.args[0] if exc.args else exc)
    return None
