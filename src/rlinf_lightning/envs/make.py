"""Making an env by name: a registered factory (``ENVS``, plugins add theirs) or else a gymnasium id."""

from __future__ import annotations

from typing import Any

from rlinf_lightning.envs.base import ENVS, EnvBatch
from rlinf_lightning.envs.gym import GymEnvBatch, ensure_registered


def make_env(name: str, num_envs: int, **kwargs: Any) -> EnvBatch:
    """The registered env ``name`` (a factory called with ``num_envs`` and ``kwargs``), or else
    the gymnasium id ``name`` as a synchronous vector env."""
    if name in ENVS:
        return ENVS.get(name)(num_envs=num_envs, **kwargs)
    return GymEnvBatch(name, num_envs, **kwargs)


def check_env(name: str) -> str | None:
    """Why ``name`` names no env (neither registered nor a gymnasium id), or ``None``; makes none."""
    if name in ENVS:
        return None
    try:
        ensure_registered(name)
    except (KeyError, ImportError) as exc:
        return str(exc.args[0] if exc.args else exc)
    return None
