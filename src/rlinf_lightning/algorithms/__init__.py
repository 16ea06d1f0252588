"""Algorithms, looked up by name in :data:`ALGORITHMS`, built from advantage estimators
(:data:`ADVANTAGE_ESTIMATORS`) and policy losses (:data:`POLICY_LOSSES`), each a registry that
plugins extend like the built-ins."""

from rlinf_lightning.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlinf_lightning.algorithms.grpo import GRPO
from rlinf_lightning.algorithms.losses import POLICY_LOSSES
from rlinf_lightning.algorithms.ppo import PPO
from rlinf_lightning.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")
ALGORITHMS.register("grpo", GRPO)
ALGORITHMS.register("ppo", PPO)

__all__ = ["ADVANTAGE_ESTIMATORS", "ALGORITHMS", "GRPO", "POLICY_LOSSES", "PPO"]
