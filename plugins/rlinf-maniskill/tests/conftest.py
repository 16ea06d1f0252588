"""ManiSkill3's CPU simulation and llvmpipe rendering on a small machine: one torch thread."""

from __future__ import annotations

import warnings

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore", module=r"mani_skill\..*")
