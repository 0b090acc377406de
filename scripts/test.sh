#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: sets up what it needs, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k transport`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
# The cluster tests run against the control plane setup just built: missing, they fail (not skip).
export ASYNCRL_REQUIRE_CONTROL_PLANE="${ASYNCRL_REQUIRE_CONTROL_PLANE:-1}"
export PATH="$PWD/.tools/bin:$PATH"
# Convert the embedded model once, before tests that load it run.
.venv/bin/python -c "from asyncrl.models import resolve_model_path as r; r('embedded:SmolLM2-135M-Instruct')"
# Static checks first (seconds): lint and types over the whole tree, as the README promises.
if [ "$#" = 0 ]; then
  echo "test.sh: ruff"
  .venv/bin/ruff check .
  echo "test.sh: mypy"
  .venv/bin/mypy
  echo "test.sh: vulture"
  .venv/bin/vulture
fi
# Some tests write whole checkpoints (GBs while they run): say how much room there is, so a
# "No space left on device" failure reads as the machine's, not the code's.
tmp="${TMPDIR:-/tmp}"
free_mb=$(df -Pm "$tmp" | awk 'NR==2 {print $4}')
echo "test.sh: ${free_mb} MB free in $tmp"
if [ "$free_mb" -lt 8000 ]; then
  echo "test.sh: warning: under 8 GB free in $tmp; the trainer tests write up to ~4 GB at once" >&2
fi
set +e
# --durations: the 30 slowest tests at the end, so where CI time goes is on record in every run.
.venv/bin/python -m pytest -ra --durations=30 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
