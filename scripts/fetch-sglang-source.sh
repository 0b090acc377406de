#!/usr/bin/env bash
# Cache the pinned SGLang release's own HTTP route table and request models (idempotent).
#
# tests/rollout/engines/test_sglang_routes.py checks every route and request field we use (readiness probe, the
# sglang adapter, tests/support/sglang_fake.py) against these files, so a probe or call the pinned server
# does not have fails in CI instead of on a cluster. The version is the single constant
# asyncrl.rollout.engines.sglang.PINNED_VERSION. The wheel is pure Python: we only download it
# (`pip download --no-deps`) and unzip a few source files; sglang is never installed.
#
# Usage: scripts/fetch-sglang-source.sh [PYTHON]   (PYTHON defaults to $REPO/.venv/bin/python)
# Result: $REPO/.tools/sglang-<version>/sglang/launch_server.py (the module the operator's engine
#         command runs: tests/rollout/engines/test_engine_images.py) and sglang/srt/{entrypoints/http_server.py,
#         entrypoints/v1_loads.py, managers/io_struct.py, sampling/sampling_params.py, server_args.py,
#         utils/common.py (SUPPORTED_LORA_TARGET_MODULES)}
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# Read the pin from the code (plain text, so this works before asyncrl is installed).
VERSION="$("$PY" -c 'import re, sys; print(re.search(r"^PINNED_VERSION = \"([^\"]+)\"", open(sys.argv[1]).read(), re.M).group(1))' \
  "$REPO/rollout/engines/sglang.py")"
DEST="$REPO/.tools/sglang-$VERSION"
FILES=(sglang/launch_server.py sglang/srt/entrypoints/http_server.py sglang/srt/entrypoints/v1_loads.py
       sglang/srt/managers/io_struct.py sglang/srt/sampling/sampling_params.py
       sglang/srt/server_args.py sglang/srt/utils/common.py)

missing=0
for f in "${FILES[@]}"; do [ -s "$DEST/$f" ] || missing=1; done
if [ "$missing" = 0 ]; then
  echo "sglang $VERSION source already in $DEST"
  exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --no-deps --only-binary=:all: --quiet --dest "$WORK" "sglang==$VERSION"
WHEEL="$(ls "$WORK"/sglang-*.whl | head -n1)"
"$PY" - "$WHEEL" "$WORK/out" "${FILES[@]}" <<'PYEOF'
import sys, zipfile
from pathlib import Path

wheel, out, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(name))
PYEOF
mkdir -p "$DEST"
cp -r "$WORK/out/." "$DEST/"
echo "$(basename "$WHEEL")" > "$DEST/WHEEL"
echo "sglang $VERSION source cached in $DEST"
