"""The auto strategy: profile the run's own stages, simulate every candidate plan, run the
fastest, and re-tune while training (``strategy.py``), with its profile (``profile.py``), event
simulator (``simulate.py``), candidate search (``search.py``) and start-up estimate (``launch.py``)."""

from rlinf_lightning.strategies.auto.profile import Profile
from rlinf_lightning.strategies.auto.strategy import AutoStrategy

__all__ = ["AutoStrategy", "Profile"]
