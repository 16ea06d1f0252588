#!/usr/bin/env bash
# Run HERE (this machine has the registry) before a session lent a GPU, whose image has no network:
# downloads the wheels scripts/gpu_check.sh installs there (what the image lacks; see its step 1)
# into .whl/ (ignored through .git/info/exclude), each pinned to the version this project's venv
# holds, for the image's CPython 3.12 on x86-64 Linux, as /work/.library/device/README.md says. No
# dependencies are resolved (--no-deps): the list is the closure the image lacks. Then, on the GPU:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
#   bash scripts/gpu_wheels.sh [DEST]      # DEST: .whl by default; $GPU_WHEELS overrides the list
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${1:-.whl}"
# the project's venv (the versions to pin are its), not whatever python3 the shell finds first
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
WHEELS="${GPU_WHEELS:-tensordict pyvers orjson jsonargparse docstring-parser typeshed-client math-verify
latex2sympy2_extended antlr4-python3-runtime datasets dill multiprocess gymnasium farama-notifications}"

if [ "$DEST" = ".whl" ]; then
    exclude="$(git rev-parse --git-path info/exclude)"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
mkdir -p "$DEST"
platforms=()
for n in 28 27 24 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for name in $WHEELS; do
    if ! version="$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$name" 2>/dev/null)"; then
        echo "$name: not in this venv, so not needed; skipped" >&2
        continue
    fi
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$DEST" "$name==$version"
    echo "$name==$version" >&2
done
du -sh "$DEST" >&2
