"""LIBERO (MuJoCo, llvmpipe rendering in one process per env) on a small machine: one torch thread."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
