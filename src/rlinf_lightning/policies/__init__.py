"""Policies: the networks being trained (``RLModule`` subclasses)."""

from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.module import RLModule

__all__ = ["LMPolicy", "RLModule"]
