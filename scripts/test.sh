#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: sets up what it needs, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k transport`).
# `bash scripts/test.sh --fast`: the tier to run before every commit, the static checks and the unit
# tests (about 2 minutes on 2 cores once set up; no control plane, no test tools, no vLLM).
#
# Without arguments, and the control plane already built (a warm machine), every test runs in one
# pytest run on two pytest-xdist workers. On a machine without it, every test that needs no
# control-plane binaries runs first (unit, integration and the cluster tests that start no binaries)
# while the control plane compiles from source at the lowest CPU priority (cold: ~23 CPU-minutes,
# soaked up by whatever CPU those tests leave); the tests marked `control_plane` run once it is
# built. With arguments, pytest waits for the build and runs once.
set -euo pipefail
cd "$(dirname "$0")/.."

# One pytest run; exit code 5 (nothing collected) is a failure here, never a vacuous pass.
# --durations: the 30 slowest tests at the end, so where CI time goes is on record in every run.
# Two pytest-xdist workers, a whole test file each at a time (--dist loadfile: a module's fixtures
# are built once), heaviest files first (the order tests/conftest.py gives, which xdist would
# otherwise replace by "most tests first"); ASYNCRL_TEST_WORKERS=0 runs in one process.
workers="${ASYNCRL_TEST_WORKERS:-2}"
run_pytest() {
  local rc=0
  .venv/bin/python -m pytest -ra --durations=30 -n "$workers" --dist loadfile --no-loadscope-reorder "$@" \
    || rc=$?
  if [ "$rc" = 5 ]; then
    echo "test.sh: pytest collected no tests ($*): that is a failure here" >&2
    rc=1
  fi
  return "$rc"
}

# Convert the embedded model once, before tests that load it run.
convert_model() {
  .venv/bin/python -c "from asyncrl.infra.hf_models import resolve_model_path as r; r('embedded:SmolLM2-135M-Instruct')"
}

if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/setup.sh
  convert_model
  bash scripts/static-checks.sh
  run_pytest -m unit "$@"
  exit
fi

prebuilt=0
if bash scripts/build-k8s-control-plane.sh --check; then
  prebuilt=1
fi
k8s_log=$(mktemp)
trap 'rm -f "$k8s_log"' EXIT
nice -n 19 bash scripts/build-k8s-control-plane.sh > "$k8s_log" 2>&1 &
k8s_pid=$!
bash scripts/setup.sh --tests --no-control-plane

wait_for_control_plane() {
  echo "test.sh: waiting for the Kubernetes control-plane build"
  if ! wait "$k8s_pid"; then
    cat "$k8s_log" >&2
    echo "test.sh: building the Kubernetes control plane failed (log above)" >&2
    exit 1
  fi
  cat "$k8s_log"
}

# The cluster tests run against the control plane just built: missing, they fail (not skip).
export ASYNCRL_REQUIRE_CONTROL_PLANE="${ASYNCRL_REQUIRE_CONTROL_PLANE:-1}"
export PATH="$PWD/.tools/bin:$PATH"
convert_model
# Static checks first (seconds): lint, types, dead code and the import layers, as the README promises.
if [ "$#" = 0 ]; then
  bash scripts/static-checks.sh
fi
# Some tests write whole checkpoints (GBs while they run): say how much room there is, so a
# "No space left on device" failure reads as the machine's, not the code's.
tmp="${TMPDIR:-/tmp}"
free_mb=$(df -Pm "$tmp" | awk 'NR==2 {print $4}')
echo "test.sh: ${free_mb} MB free in $tmp"
if [ "$free_mb" -lt 8000 ]; then
  echo "test.sh: warning: under 8 GB free in $tmp; the trainer tests write up to ~4 GB at once" >&2
fi

if [ "$#" = 0 ] && [ "$prebuilt" = 0 ]; then
  rc=0
  run_pytest -m "not control_plane" || rc=$?
  wait_for_control_plane
  run_pytest -m control_plane || rc=$?
  exit "$rc"
fi
wait_for_control_plane
run_pytest "$@"
