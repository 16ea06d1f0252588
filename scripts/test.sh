#!/usr/bin/env bash
# README command 2: set up (idempotent), lint, and run the default (fast) test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
ruff check .
python -m pytest -q "$@"
