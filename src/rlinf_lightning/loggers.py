"""Logger names, resolved through :data:`LOGGERS` like every other pluggable concept.

Each entry builds a Lightning logger writing under the run directory. wandb is always offline here:
runs are synced afterwards with ``wandb sync <default_root_dir>/wandb``; a plugin can register an
online variant under another name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlinf_lightning.registry import Registry

LOGGERS: Registry[Any] = Registry("logger")


@LOGGERS.register("csv")
def csv_logger(root: Path) -> Any:
    """CSV metrics at <default_root_dir>/logs/version_N/metrics.csv."""
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(save_dir=str(root), name="logs")


@LOGGERS.register("tensorboard")
def tensorboard_logger(root: Path) -> Any:
    """TensorBoard event files under <default_root_dir>/logs."""
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=str(root), name="logs")


@LOGGERS.register("wandb")
def wandb_logger(root: Path) -> Any:
    """Weights & Biases, offline (sync later with `wandb sync`)."""
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(save_dir=str(root), offline=True)
