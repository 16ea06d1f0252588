"""Algorithms, looked up by name in :data:`ALGORITHMS`: named presets (an advantage estimator from
:data:`ADVANTAGE_ESTIMATORS`, a policy loss from :data:`POLICY_LOSSES`, an aggregation and
options) and PPO with a critic; off-policy corrections for asynchronous RL from
:data:`OFF_POLICY_CORRECTIONS`. All these registries are extended by plugins like the built-ins;
what each entry reads is declared (``algorithms.contract``) and checked against what the task's
workflow provides before anything loads."""

from rlinf_lightning.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlinf_lightning.algorithms.contract import Algorithm
from rlinf_lightning.algorithms.losses import OFF_POLICY_CORRECTIONS, POLICY_LOSSES
from rlinf_lightning.algorithms.policy_gradient import PolicyGradient
from rlinf_lightning.algorithms.ppo import PPO
from rlinf_lightning.algorithms.presets import (
    CISPO,
    DAPO,
    GRPO,
    GSPO,
    PRESETS,
    RLOO,
    DrGRPO,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
)
from rlinf_lightning.algorithms.sac import RLPD, SAC, CrossQ
from rlinf_lightning.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")
for _name, _preset in PRESETS.items():
    ALGORITHMS.register(_name, _preset)
ALGORITHMS.register("ppo", PPO)
ALGORITHMS.register("sac", SAC)
ALGORITHMS.register("rlpd", RLPD)
ALGORITHMS.register("crossq", CrossQ)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "Algorithm",
    "CISPO",
    "CrossQ",
    "DAPO",
    "GRPO",
    "GSPO",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "PPO",
    "RLOO",
    "RLPD",
    "SAC",
    "DrGRPO",
    "PolicyGradient",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
]
