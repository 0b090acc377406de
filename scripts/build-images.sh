#!/usr/bin/env bash
# Build asyncrl's container images from images/*.Dockerfile with podman or docker (whichever is
# present; ASYNCRL_CONTAINER_TOOL chooses), from the repository root, reusing cached layers.
#
# Usage: bash scripts/build-images.sh [--local-base] [IMAGE...]
#   IMAGE         operator (the images built by this script so far; default: all of them)
#   --local-base  make the Debian base here instead of pulling debian:bookworm-slim: mmdebstrap builds
#                 bookworm (variant minbase, the packages debian:bookworm-slim is made of) from the
#                 package mirror, imported once as localhost/asyncrl/debian:bookworm-minbase and
#                 passed as BASE (podman only). For machines that reach a package mirror but no image
#                 registry, such as the test machines.
# Environment:
#   ASYNCRL_IMAGE_REGISTRY  repository prefix (default ghcr.io/asyncrl): REGISTRY/operator:TAG
#   ASYNCRL_IMAGE_TAG       tag (default: asyncrl's version, which the chart and the operator default to)
#   ASYNCRL_BUILD_CA        a CA bundle the build's apt and pip must trust (a TLS-intercepting proxy),
#                           mounted read-only for the RUN steps and given to pip (PIP_CERT; podman only);
#                           default: this machine's /etc/ssl/certs/ca-certificates.crt with --local-base
# Prints one line per image: its reference, size and build seconds. Then push it with
# `podman push REF` / `docker push REF` and point the chart at it (docs/operator.md, "Images").
set -euo pipefail
cd "$(dirname "$0")/.."

LOCAL_BASE=0
IMAGES=()
for arg in "$@"; do
  case "$arg" in
    --local-base) LOCAL_BASE=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    operator) IMAGES+=("$arg") ;;
    *) echo "build-images.sh: unknown image or option '$arg' (images: operator; option: --local-base)" >&2; exit 2 ;;
  esac
done
[ "${#IMAGES[@]}" -gt 0 ] || IMAGES=(operator)

TOOL="${ASYNCRL_CONTAINER_TOOL:-}"
if [ -z "$TOOL" ]; then
  if command -v podman >/dev/null 2>&1; then TOOL=podman
  elif command -v docker >/dev/null 2>&1; then TOOL=docker
  else echo "build-images.sh: neither podman nor docker found (scripts/install-container-tools.sh installs podman)" >&2; exit 1
  fi
fi
if [ "$TOOL" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && [ -f .tools/podman/containers.conf ]; then
  export CONTAINERS_CONF="$PWD/.tools/podman/containers.conf"  # (this machine's settings: install-container-tools.sh)
fi

REGISTRY="${ASYNCRL_IMAGE_REGISTRY:-ghcr.io/asyncrl}"
TAG="${ASYNCRL_IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)}"
ARGS=(--network host)
if [ "$LOCAL_BASE" = 1 ]; then
  [ "$TOOL" = podman ] || { echo "build-images.sh: --local-base needs podman (podman import)" >&2; exit 1; }
  BASE=localhost/asyncrl/debian:bookworm-minbase
  if ! podman image exists "$BASE"; then
    command -v mmdebstrap >/dev/null 2>&1 || { echo "build-images.sh: --local-base needs mmdebstrap" >&2; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    start=$(date +%s)
    mmdebstrap --quiet --variant=minbase bookworm "$work/base.tar"
    podman import --quiet "$work/base.tar" "$BASE" >/dev/null
    echo "build-images.sh: made $BASE with mmdebstrap in $(( $(date +%s) - start ))s" >&2
  fi
  ARGS+=(--build-arg "BASE=$BASE")
  CA="${ASYNCRL_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
else
  CA="${ASYNCRL_BUILD_CA:-}"
fi
if [ -n "$CA" ]; then
  [ "$TOOL" = podman ] || { echo "build-images.sh: ASYNCRL_BUILD_CA needs podman (build --volume)" >&2; exit 1; }
  ARGS+=(--volume "$CA:/run/asyncrl-build-ca.crt:ro" --build-arg PIP_CERT=/run/asyncrl-build-ca.crt)
fi

for image in "${IMAGES[@]}"; do
  ref="$REGISTRY/$image:$TAG"
  start=$(date +%s)
  "$TOOL" build "${ARGS[@]}" -f "images/$image.Dockerfile" -t "$ref" . >&2
  size=$("$TOOL" image inspect --format '{{.Size}}' "$ref")
  echo "$ref $(( size / 1000000 )) MB $(( $(date +%s) - start ))s"
done
