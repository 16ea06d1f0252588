#!/usr/bin/env bash
# The GPU checks of issue 43 in one command, for a session that is lent a GPU machine (no network).
#
#   bash scripts/gpu_check.sh                      # on the GPU: every part, Qwen2.5-0.5B's shape
#   bash scripts/gpu_check.sh --device cpu --shape tiny --sequences 8 --group 4 --new-tokens 8 \
#       --max-tokens 128,256 --steps 2 --repeats 1 --ops-rows 4,16   # the same script on a CPU (tests)
#
# 1. Installs the small wheels the GPU image lacks (/work/.library/device/KINDS.md lists what it
#    has: torch 2.11, transformers 5.17, lightning; not tensordict, pyvers, orjson, jsonargparse,
#    docstring-parser, typeshed-client, math-verify, latex2sympy2_extended, antlr4-python3-runtime,
#    datasets, dill, multiprocess, gymnasium, farama-notifications) from $RLINF_WHEELS, else the
#    first of .whl/ (the device tool's convention: `bash scripts/gpu_wheels.sh` fills it here, with
#    network, and the run names it in `carry`), shared/wheels, wheels/ that holds wheels, into a
#    target directory put first on PYTHONPATH; nothing is downloaded there. Then checks once that
#    what every part imports does: where something does not (the wheels were not carried), it prints
#    one line naming it and the fix, and exits 2 before any part runs.
# 2. Runs benchmarks/gpu.py one part at a time, each under `timeout`: $PART_TIMEOUT seconds, or what
#    is left of $GPU_CHECK_TOTAL_S (default 540, inside the device tool's 600 s a command) if less,
#    so one part that hangs or runs out of memory leaves the others' figures, and the whole script
#    ends in time; a part with under 30 s left is skipped. Each part's log goes to $OUT (the device
#    tool's output folder, which comes back) or a temporary folder.
# 3. Prints one JSON object merging every part's last line (a part that failed: {"error": ...}),
#    also written to $OUT/gpu_check.json (at most 7 files come back: the device tool takes 8).
#
# On a lent machine:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Parts: $GPU_CHECK_PARTS (default below: the issue's GPU bars first, `compile` among them, since
# the eager step's MFU ceiling is 0.41 (the `bound` section); then what explains them, in the time
# left). Extra arguments go to every benchmarks/gpu.py
# call; the `actor` part also prints its step's top kernels (--profile) into its log, so that one
# run says where the actor's time goes.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PARTS="${GPU_CHECK_PARTS:-defaults generate actor compile chunked decode_ops}"
PART_TIMEOUT="${PART_TIMEOUT:-240}"
LOGS="${OUT:-$(mktemp -d)}"
PYTHON="${PYTHON:-python3}"  # the GPU image's python3 holds its torch

START=$SECONDS
TOTAL="${GPU_CHECK_TOTAL_S:-540}"

for dir in "${RLINF_WHEELS:-}" .whl shared/wheels wheels; do
    if [ -n "$dir" ] && compgen -G "$dir/*.whl" > /dev/null; then
        SITE="${RLINF_SITE:-/tmp/rlinf-gpu-site}"
        echo "installing $(ls "$dir"/*.whl | wc -l) wheels from $dir into $SITE" >&2
        timeout 180 "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$dir"/*.whl >&2 \
            || echo "wheel install failed; continuing with what the image has" >&2
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        break
    fi
done
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

# what every part imports, checked once (and torch's version and device said): without the wheels
# each part would fail alike, and the device time is better spent on one line that says what to do
missing="$(timeout 120 "$PYTHON" - <<'PY'
import importlib
import sys

for name in ("torch", "transformers", "tensordict", "jsonargparse", "math_verify", "rlinf_lightning.tasks"):
    try:
        importlib.import_module(name)
    except ImportError as err:
        sys.exit(print(err.name or name))
import torch

cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", cuda, torch.cuda.get_device_name(0) if cuda else "", file=sys.stderr)
PY
)" || missing="${missing:-the import check (it timed out or crashed)}"
if [ -n "$missing" ]; then
    why="$PYTHON cannot import $missing: run 'bash scripts/gpu_wheels.sh' where the package index is"
    why="$why reachable, then run(command=\"bash scripts/gpu_check.sh\", carry=[\".whl\"])"
    echo "gpu_check: $why" >&2
    "$PYTHON" -c 'import json, sys; print(json.dumps({"error": sys.argv[1]}))' "$why" 2>/dev/null \
        || echo '{"error": "see stderr"}'
    exit 2
fi

for part in $PARTS; do
    left=$((TOTAL - (SECONDS - START) - 10))  # 10 s for the merge below
    limit=$((left < PART_TIMEOUT ? left : PART_TIMEOUT))
    if [ "$limit" -lt 30 ]; then
        echo "{\"$part\": {\"error\": \"skipped: ${left}s left of GPU_CHECK_TOTAL_S=$TOTAL\"}}" > "$LOGS/gpu_$part.log"
        echo "$part: skipped (${left}s left)" >&2
        continue
    fi
    echo "== $part (timeout ${limit}s)" >&2
    extra=()
    [ "$part" = actor ] && extra=(--profile)
    timeout "$limit" "$PYTHON" benchmarks/gpu.py --sections "$part" "${extra[@]}" "$@" > "$LOGS/gpu_$part.log" 2>&1
    rc=$?
    tail -n 3 "$LOGS/gpu_$part.log" | cut -c1-400 >&2
    [ "$rc" -eq 0 ] || echo "$part: exit $rc" >&2
done

"$PYTHON" - "$LOGS" $PARTS <<'EOF'
import json, sys
from pathlib import Path

logs, parts, merged = Path(sys.argv[1]), sys.argv[2:], {}
for part in parts:
    lines = (logs / f"gpu_{part}.log").read_text().strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        merged[part] = {"error": (lines[-1] if lines else "no output")[:300]}
        continue
    merged.setdefault("device", result.get("device"))
    merged[part] = result.get(part, result)
line = json.dumps(merged)
(logs / "gpu_check.json").write_text(line + "\n")
print(line)
EOF
