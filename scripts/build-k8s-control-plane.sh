#!/usr/bin/env bash
# Build the Kubernetes control plane the cluster tests run against (tests/support/control_plane.py):
#   etcd, kube-apiserver, kube-controller-manager and kube-scheduler, from source, with the Go
#   module in tools/k8s (the versions are pinned there). No container runtime, no downloads of
#   release binaries: only the Go module proxy. Cold ~23 CPU-minutes; a no-op when built.
# Output: the binaries in $ASYNCRL_K8S_BIN, by default
#   ${XDG_CACHE_HOME:-$HOME/.cache}/asyncrl/k8s/<version>/bin; the last line printed is that dir.
# Usage: bash scripts/build-k8s-control-plane.sh [--force | --check]   (--force rebuilds even when
#   present; --check builds nothing and exits 0 when the binaries are there, 1 when they are not)
set -euo pipefail
cd "$(dirname "$0")/.."

MODULE_DIR=tools/k8s
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler)

FORCE=0
CHECK=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-k8s-control-plane.sh: unknown option $arg (allowed: --force, --check, --help)" >&2; exit 2 ;;
  esac
done

log() { echo "build-k8s-control-plane: $*"; }

# The version is the one tools/k8s/go.mod requires, so the cache key cannot drift from the build.
VERSION=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$MODULE_DIR/go.mod")
if [ -z "$VERSION" ]; then
  echo "build-k8s-control-plane: no k8s.io/kubernetes requirement in $MODULE_DIR/go.mod" >&2
  exit 1
fi
BIN_DIR=${ASYNCRL_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/asyncrl/k8s/$VERSION/bin}

# True when every binary is there and the apiserver reports the pinned version (a binary built
# without the version ldflags says v0.0.0, and clients such as helm then misjudge the server).
built() {
  local name
  for name in "${BINARIES[@]}"; do
    [ -x "$BIN_DIR/$name" ] || return 1
  done
  "$BIN_DIR/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $VERSION"
}

if [ "$CHECK" = 1 ]; then
  built
  exit
fi
if [ "$FORCE" = 0 ] && built; then
  log "$VERSION already built"
  echo "$BIN_DIR"
  exit 0
fi

if ! command -v go >/dev/null; then
  echo "build-k8s-control-plane: needs Go (>= the 'go' line of $MODULE_DIR/go.mod) on PATH" >&2
  exit 1
fi

# kubectl and helm read the server version from these; major/minor come from the tag.
minor=${VERSION#v1.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean"
done

# Build into a scratch dir beside the target and move each binary in only when all four built,
# so an interrupted build never leaves a half-set that `built` would accept.
mkdir -p "$BIN_DIR"
stage=$(mktemp -d "$BIN_DIR/.build.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# Go's build and module caches (~4.5 GB here) serve only this build: unless the caller chose
# its own, they live in the scratch dir and go with it.
if [ -z "${GOCACHE:-}" ]; then export GOCACHE="$stage/go-build"; fi
if [ -z "${GOMODCACHE:-}" ]; then export GOMODCACHE="$stage/go-mod" GOFLAGS="${GOFLAGS:-} -modcacherw"; fi

log "building $VERSION into $BIN_DIR ($(go version | awk '{print $3}'), $(nproc) cores)"
start=$SECONDS
log "downloading modules"
(cd "$MODULE_DIR" && go mod download)
for name in "${BINARIES[@]}"; do
  case "$name" in
    etcd) pkg=go.etcd.io/etcd/server/v3 ;;
    *) pkg=k8s.io/kubernetes/cmd/$name ;;
  esac
  t0=$SECONDS
  log "go build $pkg -> $name"
  (cd "$MODULE_DIR" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$stage/$name" "$pkg")
  log "built $name in $((SECONDS - t0)) s ($(du -h "$stage/$name" | cut -f1))"
done
for name in "${BINARIES[@]}"; do
  mv -f "$stage/$name" "$BIN_DIR/$name"
done

if ! built; then
  echo "build-k8s-control-plane: built, but '$BIN_DIR/kube-apiserver --version' does not say $VERSION:" >&2
  "$BIN_DIR/kube-apiserver" --version >&2 || true
  exit 1
fi
log "done in $((SECONDS - start)) s: $("$BIN_DIR/kube-apiserver" --version), etcd $("$BIN_DIR/etcd" --version | awk 'NR==1 {print $3}')"
echo "$BIN_DIR"
