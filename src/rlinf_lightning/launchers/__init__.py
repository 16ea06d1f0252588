"""Launchers start a plan's workers; looked up by name in :data:`LAUNCHERS`."""

from rlinf_lightning.launchers.base import Launcher, Runtime, WorkerDied
from rlinf_lightning.launchers.inprocess import InProcessLauncher
from rlinf_lightning.launchers.processes import ProcessLauncher
from rlinf_lightning.launchers.ray import RayLauncher
from rlinf_lightning.registry import Registry

LAUNCHERS: Registry[type[Launcher]] = Registry("launcher")
LAUNCHERS.register("inprocess", InProcessLauncher)
LAUNCHERS.register("processes", ProcessLauncher)
LAUNCHERS.register("ray", RayLauncher)

__all__ = [
    "LAUNCHERS",
    "InProcessLauncher",
    "Launcher",
    "ProcessLauncher",
    "RayLauncher",
    "Runtime",
    "WorkerDied",
]
