"""rlinf-lightning: Lightning-style RL post-training with execution plans (RLinf's M2Flow).

import rlinf_lightning as rl
trainer = rl.RLTrainer(algorithm="grpo", strategy="collocated", max_iterations=100)
task = rl.tasks.MathTask("train.jsonl", "test.jsonl", group_size=8, rollout="hf")
trainer.fit(rl.LMPolicy("artifacts/tiny-qwen2-sft"), task)
"""

import logging
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep logs to one line per event

from rlinf_lightning import algorithms, callbacks, console, engines, flow, launchers, strategies, tasks
from rlinf_lightning.callbacks import Callback, ProgressBar
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy, RLModule
from rlinf_lightning.tasks import RunSpec
from rlinf_lightning.trainer import RLTrainer

__version__ = "0.1.0"

# As Lightning does: the library's own INFO messages (the plan, the held-out result) are shown, on
# our handlers unless the application configured logging itself (the ``rlinf`` CLI re-installs
# them at the level of --quiet / --verbose); see ``console``.
logging.getLogger(__name__).setLevel(logging.INFO)
if not logging.getLogger().handlers:
    console.install()

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
