"""Policies: the networks being trained (``RLModule`` subclasses). A config picks one by
``class_path`` (LightningCLI's subclass mode), so any user subclass works the same way."""

from rlinf_lightning.policies.crossq import CrossQPolicy
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.mlp import MLPActorCritic
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.policies.pi0 import Pi0Policy
from rlinf_lightning.policies.sac import SACPolicy
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.policies.vla import TinyVLA

__all__ = [
    "CrossQPolicy",
    "LMPolicy",
    "MLPActorCritic",
    "Pi0Policy",
    "RLModule",
    "SACPolicy",
    "TinyVLA",
    "ValueModel",
]
