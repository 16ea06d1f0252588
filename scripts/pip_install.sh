#!/usr/bin/env bash
# `pip install ARGS` for the set-up (scripts/setup.sh exports it as RLINF_PIP_INSTALL, and the
# plugins' install.sh use it when set): through uv when it is on PATH, which installs the same
# requirements many times faster (parallel, no per-call index rescans), given pip's own
# configuration (index URLs, find-links, constraints, from files and PIP_* variables) and pip's
# rule of taking the best version from every index; through pip itself when uv is missing or fails.
set -euo pipefail
if command -v uv >/dev/null 2>&1; then
  args=(--python "$(command -v python)" --index-strategy unsafe-best-match)
  while IFS= read -r line; do  # e.g. global.extra-index-url='file:///a file:///b'
    key=${line%%=*}
    key=${key##*.}
    value=${line#*=}
    value=${value#\'}
    value=${value%\'}
    case "$key" in
      index-url) args+=(--index-url "$value") ;;
      extra-index-url) for v in $value; do args+=(--extra-index-url "$v"); done ;;
      find-links) for v in $value; do args+=(--find-links "$v"); done ;;
      constraint) for v in $value; do args+=(--constraint "$v"); done ;;
    esac
  done < <(python -m pip config list 2>/dev/null || true)
  if UV_LINK_MODE=copy uv pip install "${args[@]}" "$@"; then
    exit 0
  fi
  echo "pip_install: uv could not install $*; trying pip" >&2
fi
exec python -m pip install "$@"
