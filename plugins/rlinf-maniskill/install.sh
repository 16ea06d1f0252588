#!/usr/bin/env bash
# Install ManiSkill3 and this plugin into the active environment (idempotent; quick when done).
#
# 1. Vulkan for SAPIEN's renderer (Debian bookworm, as root): SAPIEN 3 refuses bookworm's lavapipe
#    (Mesa 22.3.6: "failed to find a rendering device"); Mesa 25 from bookworm-backports works. The
#    backports suite is added (same URI and keyring as the main Debian source) if it is missing, and
#    mesa-vulkan-drivers is installed from it. Skipped elsewhere (a GPU machine renders with the
#    NVIDIA driver's own Vulkan ICD).
# 2. mani-skill 3.0.1 with --no-deps plus its listed requirements, with torch held at the version
#    already installed (2.13.0: CPU build here), so pip never swaps in a CUDA torch. torchvision is
#    not needed (mani-skill imports it only in its optional visual-encoder wrapper).
# 3. This plugin, --no-deps -e.
set -Eeuo pipefail
step="start"  # what is being done, for the one line that names a failure
trap 'echo "rlinf-maniskill/install.sh: failed while $step (exit $?)" >&2' ERR
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

mesa_ok() {  # mesa-vulkan-drivers >= 23 installed
  local v
  v="$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)"
  [ -n "$v" ] && dpkg --compare-versions "$v" ge 23
}

codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
if [ "$codename" = "bookworm" ] && command -v apt-get >/dev/null 2>&1 && ! mesa_ok; then
  if [ "$(id -u)" != 0 ]; then
    echo "rlinf-maniskill: run as root to install mesa-vulkan-drivers from bookworm-backports" >&2
    exit 1
  fi
  shopt -s nullglob
  if ! grep -qs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
      /etc/apt/sources.list.d/*.sources; then
    # URI and keyring of the main suite (the deb822 stanza whose Suites has plain "bookworm")
    read -r uri key < <(awk '
      BEGIN { RS = ""; FS = "\n" }
      {
        u = ""; k = ""; s = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { u = $i; sub(/^URIs:[ \t]*/, "", u); sub(/[ \t].*/, "", u) }
          if ($i ~ /^Signed-By:/) { k = $i; sub(/^Signed-By:[ \t]*/, "", k) }
          if ($i ~ /^Suites:/ && $i ~ /[ \t]bookworm([ \t]|$)/) s = 1
        }
        if (s && u != "") { print u, (k == "" ? "-" : k); exit }
      }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    uri="${uri:-http://deb.debian.org/debian}"
    key="${key:--}"
    [ "$key" = "-" ] && key=/usr/share/keyrings/debian-archive-keyring.gpg
    step="adding the bookworm-backports apt source"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
      "$uri" "$key" > /etc/apt/sources.list.d/bookworm-backports.sources
  fi
  step="updating apt's package lists"
  apt_get update -qq
  step="installing mesa-vulkan-drivers from bookworm-backports with apt-get"
  apt_get install -y -qq -t bookworm-backports mesa-vulkan-drivers
fi

prefix="$(python -c 'import sys; print(sys.prefix)')"
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('mani-skill') != '3.0.1')" 2>/dev/null
then
  step="installing mani-skill 3.0.1 and its requirements with pip"
  torch_version="$(python -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')"
  # mani-skill 3.0.1's Requires-Dist (Linux), with torch pinned to the version installed
  $pip_install -q "torch==${torch_version}" \
    "numpy>=1.22" scipy dacite "gymnasium>=0.29.1" h5py pyyaml tqdm GitPython tabulate transforms3d \
    trimesh "imageio[ffmpeg]" "mplib==0.1.1" IPython "pytorch_kinematics==0.7.6" defusedxml \
    nvidia-ml-py "tyro>=0.8.5" huggingface_hub "sapien>=3.0.0"
  $pip_install -q --no-deps "mani-skill==3.0.1"
fi
# this plugin, editable; again only when its pyproject.toml or location changed
stamp="$prefix/.rlinf-maniskill-installed"
want="$(sha256sum < "$here/pyproject.toml" | cut -c1-16) $here"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
    || ! python -c "import importlib.metadata as m; m.version('rlinf-maniskill')" 2>/dev/null; then
  step="installing the plugin with pip"
  $pip_install -q --no-deps -e "$here"
  echo "$want" > "$stamp"
fi
step="checking that torch stayed at 2.13.0"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
