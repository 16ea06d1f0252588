#!/usr/bin/env bash
# README command 2: set up (idempotent), lint, and run the default (fast) test suite of the core
# package and of every first-party plugin. Extra arguments go to pytest, e.g. `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
ruff check .
python -m pytest -q tests $(ls -d plugins/*/tests 2>/dev/null) "$@"
