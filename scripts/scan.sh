#!/usr/bin/env bash
# Security scan of what we ship to a cluster: checkov over the Helm chart (`helm template`) and over
# the objects the operator renders for every examples/*.yaml. Fails (exit 1) on a finding that
# security/checkov-accepted.yaml does not accept, and on an accepted entry that no longer occurs;
# exit 2 when the scan cannot run. checkov comes from scripts/install-checkov.sh (setup.sh --tests).
# Arguments go to the gate: `bash scripts/scan.sh --help` (python -m asyncrl.operator.checkov_gate).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m asyncrl.operator.checkov_gate "$@"
