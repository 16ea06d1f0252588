"""rlinf-lightning: Lightning-style RL post-training with execution plans (RLinf's M2Flow).

import rlinf_lightning as rl
trainer = rl.RLTrainer(algorithm="grpo", strategy="collocated", max_iterations=100)
task = rl.tasks.MathTask("train.jsonl", "test.jsonl", group_size=8, rollout="hf")
trainer.fit(rl.LMPolicy("artifacts/tiny-qwen2-sft"), task)
"""

import logging
import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep logs to one line per event

from rlinf_lightning import algorithms, callbacks, engines, flow, launchers, strategies, tasks
from rlinf_lightning.callbacks import Callback, ProgressBar
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy, RLModule
from rlinf_lightning.tasks import RunSpec
from rlinf_lightning.trainer import RLTrainer

# As Lightning does: the library's own INFO messages (the plan, the held-out result) reach stdout
# unless the application configured logging itself (the ``rlinf`` CLI installs a rich handler).
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler(sys.stdout))
    _logger.propagate = False

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "ConfigError",
    "LMPolicy",
    "ProgressBar",
    "RLModule",
    "RLTrainer",
    "RunSpec",
    "SamplingParams",
    "algorithms",
    "callbacks",
    "engines",
    "flow",
    "launchers",
    "strategies",
    "tasks",
]
