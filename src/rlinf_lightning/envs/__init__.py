"""Environments for embodied RL: :class:`EnvBatch` and the :data:`ENVS` registry."""

from rlinf_lightning.envs.base import ENVS, EnvBatch, Step, make_env

__all__ = ["ENVS", "EnvBatch", "Step", "make_env"]
