#!/usr/bin/env bash
# README command 1: set up (idempotent), warm-start the tiny model (cached), then the main job:
# tiny math GRPO on the embedded defaults. Extra arguments go to `rlinf fit`, e.g.
#   bash scripts/run.sh --trainer.max_iterations=100
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # bytecode is written once, as imported (scripts/setup.sh says why)
bash scripts/setup.sh
source .venv/bin/activate
rlinf sft --config configs/math_sft_tiny.yaml
rlinf fit --config configs/math_grpo_tiny.yaml "$@"
