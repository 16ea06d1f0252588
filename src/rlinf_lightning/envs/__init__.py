"""Environments for embodied RL: :class:`EnvBatch`, the :data:`ENVS` registry and :func:`make_env`."""

from rlinf_lightning.envs.base import ENVS, EnvBatch, Step
from rlinf_lightning.envs.make import check_env, import_env, make_env

__all__ = ["ENVS", "EnvBatch", "Step", "check_env", "import_env", "make_env"]
