"""Algorithms: advantage estimators and policy losses, looked up by name in :data:`ALGORITHMS`."""

from rlinf_lightning.algorithms.grpo import GRPO
from rlinf_lightning.algorithms.ppo import PPO
from rlinf_lightning.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")
ALGORITHMS.register("grpo", GRPO)
ALGORITHMS.register("ppo", PPO)

__all__ = ["ALGORITHMS", "GRPO", "PPO"]
