"""Strategies produce execution plans; looked up by name in :data:`STRATEGIES`."""

from functools import partial

from rlinf_lightning.registry import Registry
from rlinf_lightning.strategies.auto import AutoStrategy
from rlinf_lightning.strategies.base import Replan, Resources, RunInfo, Strategy
from rlinf_lightning.strategies.collocated import CollocatedStrategy
from rlinf_lightning.strategies.disaggregated import DisaggregatedStrategy
from rlinf_lightning.strategies.hybrid import HybridStrategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
STRATEGIES.register("collocated", CollocatedStrategy)
STRATEGIES.register(
    "collocated_offload",
    partial(CollocatedStrategy, offload=True),
    description="Collocated with context switching: each stage offloads its state after its turn.",
)
STRATEGIES.register("disaggregated", DisaggregatedStrategy)
STRATEGIES.register("hybrid", HybridStrategy)
STRATEGIES.register("auto", AutoStrategy)

__all__ = [
    "STRATEGIES",
    "AutoStrategy",
    "CollocatedStrategy",
    "DisaggregatedStrategy",
    "HybridStrategy",
    "Replan",
    "Resources",
    "RunInfo",
    "Strategy",
]
