"""CallbackConnector: the run's callbacks (the progress bar added when enabled) and their hooks."""

from __future__ import annotations

from typing import Any

from rlinf_lightning.callbacks import ProgressBar
from rlinf_lightning.registry import instantiate


class CallbackConnector:
    """Instantiates callback specs once per fit and calls a hook on each, in order."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def setup(self) -> None:
        t = self.trainer
        t.callbacks = [instantiate(c) for c in t.callbacks]
        if t.enable_progress_bar and not any(isinstance(c, ProgressBar) for c in t.callbacks):
            t.callbacks.append(ProgressBar())

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.trainer.callbacks:
            getattr(cb, hook)(self.trainer, *args)
