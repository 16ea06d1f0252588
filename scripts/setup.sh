#!/usr/bin/env bash
# Idempotent set-up on a machine with only python3: .venv, torch==2.13.0 (CPU build, first, so that
# no later requirement pulls a CUDA build), this package with its dev extras, the first-party
# plugins (each plugins/<name>/install.sh), and the tiny assets (model, tokenizer, arithmetic data).
# Quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of what it imports, once, as it does by default. Where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) it never would, and every process,
# each test's `rlinf` run and worker among them, compiled torch's and transformers' sources again
# (a fresh clone's test suite ran 978 s instead of 567). Writing only what is imported costs
# seconds; compiling all of site-packages ahead took 54 s of every fresh set-up. README command 1
# and 2 (scripts/run.sh, scripts/test.sh) unset it too.
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.rlinf-setup
shopt -s nullglob  # no plugins: the globs below expand to nothing
want="$(cat pyproject.toml scripts/setup.sh scripts/pip_install.sh plugins/*/pyproject.toml plugins/*/install.sh | sha256sum | cut -c1-16)"
# every install goes through scripts/pip_install.sh: uv where it installs (a minute for the whole
# set-up instead of several), pip otherwise; the plugins' installers read the same variable
export RLINF_PIP_INSTALL="$PWD/scripts/pip_install.sh"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q uv || echo "setup: no uv on the package index; installing with pip (slower)" >&2
  "$RLINF_PIP_INSTALL" -q torch==2.13.0
  "$RLINF_PIP_INSTALL" -q -e '.[dev]'
  for installer in plugins/*/install.sh; do
    if [ -f "$installer" ] && ! bash "$installer"; then
      echo "setup: the plugin installer $installer failed (its line above says at which step); rerun setup once fixed" >&2
      exit 1
    fi
  done
  echo "$want" > "$stamp"
fi
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
rlinf prepare --model smollm2-135m-instruct  # tiny assets + SmolLM2-135M-Instruct (cached)
