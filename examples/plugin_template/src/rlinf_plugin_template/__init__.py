"""rlinf-plugin-template: a reward, an environment and a strategy, registered by name."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """Entry point (group ``rlinf_lightning.plugins``): add this package's entries."""
    from rlinf_lightning.envs import ENVS
    from rlinf_lightning.rewards import REWARDS
    from rlinf_lightning.strategies import STRATEGIES
    from rlinf_plugin_template.env import PointReach
    from rlinf_plugin_template.reward import ConciseMath
    from rlinf_plugin_template.strategy import SingleWorkerStrategy

    origin = "rlinf-plugin-template"
    REWARDS.register("concise_math", ConciseMath, origin=origin)
    ENVS.register("PointReach-v0", PointReach, origin=origin)
    STRATEGIES.register("single_worker", SingleWorkerStrategy, origin=origin)
