#!/usr/bin/env bash
# README command 2: set up (idempotent), lint, build the documentation site, and run the default
# (fast) test suite of the core package and of every first-party plugin. `--all` runs every test,
# the `slow` ones too (the full launcher-and-plan matrix, the learning runs, the soak); other
# arguments go to pytest, e.g. `-m slow` for the slow ones alone.
# Each plugin's tests run in their own pytest process, as a user with only that plugin would run
# them: simulators and engines patch and import process-wide state (vLLM walks sys.modules, and
# trimesh, which ManiSkill imports, raises on attribute access), so one plugin's imports must
# never decide whether another's tests pass. Every suite runs; the exit status is the first failure's.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # bytecode is written once, as imported (scripts/setup.sh says why)
args=()
for arg in "$@"; do
  # pyproject's addopts deselect `slow`; a later -m replaces it
  if [ "$arg" = "--all" ]; then args+=(-m "slow or not slow"); else args+=("$arg"); fi
done
bash scripts/setup.sh
source .venv/bin/activate
ruff check .
# no installed or admitted dependency version with a known advisory (the list is in the script)
python scripts/advisories.py
# the documentation site: any warning (a broken link, a missing page) fails; the configuration
# reference is generated from the code while it builds (docs/hooks/config_reference.py)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir site
# The core suite first, alone, on two pytest-xdist workers (`-n 0`: one process); then the plugins'
# suites, two at a time, each printed whole once all end (docs/index.md says why and what it saves).
run_suite() {  # run_suite DIR: pytest on one suite; 5 (no tests collected, e.g. -m slow) is a pass
  local rc=0 workers=()
  echo "== $1"
  if [ "$1" = tests ]; then workers=(-n 2 --dist loadfile); fi
  python -m pytest -q --durations=25 "$1" ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"} || rc=$?
  if [ "$rc" = 5 ]; then rc=0; fi
  return "$rc"
}
status=0
failed() { if [ "$1" != 0 ] && [ "$status" = 0 ]; then status=$1; fi; }
rc=0
run_suite tests || rc=$?
failed "$rc"
out=$(mktemp -d)
n=0
for suite in plugins/*/tests; do
  [ -d "$suite" ] || continue
  while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
  (rc=0; run_suite "$suite" > "$out/$n.log" 2>&1 || rc=$?; echo "$rc" > "$out/$n.rc") &
  n=$((n + 1))
done
wait
for ((i = 0; i < n; i++)); do
  cat "$out/$i.log"
  failed "$(cat "$out/$i.rc")"
done
rm -rf "$out"
exit "$status"
