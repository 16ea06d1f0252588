"""Policies: the networks being trained (``RLModule`` subclasses), registered by name in
:data:`POLICIES`."""

from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.mlp import MLPActorCritic
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.policies.vla import TinyVLA
from rlinf_lightning.registry import Registry

POLICIES: Registry[type[RLModule]] = Registry("policy")
POLICIES.register("lm", LMPolicy)
POLICIES.register("mlp", MLPActorCritic)
POLICIES.register("vla", TinyVLA)

__all__ = ["POLICIES", "LMPolicy", "MLPActorCritic", "RLModule", "TinyVLA"]
