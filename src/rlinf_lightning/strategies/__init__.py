"""Strategies produce execution plans; looked up by name in :data:`STRATEGIES`."""

from rlinf_lightning.registry import Registry
from rlinf_lightning.strategies.base import Resources, Strategy
from rlinf_lightning.strategies.collocated import CollocatedStrategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
STRATEGIES.register("collocated", CollocatedStrategy)

__all__ = ["STRATEGIES", "CollocatedStrategy", "Resources", "Strategy"]
