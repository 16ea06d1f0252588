"""rlinf-lightning: Lightning-style RL post-training with execution plans (RLinf's M2Flow).

import rlinf_lightning as rl
trainer = rl.RLTrainer(algorithm="grpo", strategy="collocated", max_iterations=100)
trainer.fit(rl.LMPolicy("artifacts/tiny-qwen2-sft"), rl.tasks.MathTask("train.jsonl", "test.jsonl"))
"""

import logging
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep logs to one line per event

from rlinf_lightning import algorithms, callbacks, console, engines, flow, launchers, strategies, tasks
from rlinf_lightning.callbacks import Callback, ProgressBar
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy, RLModule
from rlinf_lightning.trainer import RLTrainer

__version__ = "0.1.0"

if not logging.getLogger().handlers:  # the application configured no logging: show ours at INFO
    console.install()

__all__ = [
    "Callback",
    "ConfigError",
    "LMPolicy",
    "ProgressBar",
    "RLModule",
    "RLTrainer",
    "SamplingParams",
    "algorithms",
    "callbacks",
    "engines",
    "flow",
    "launchers",
    "strategies",
    "tasks",
]
