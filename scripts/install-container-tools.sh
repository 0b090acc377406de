#!/usr/bin/env bash
# Installs what scripts/build-images.sh needs here: podman, runc and mmdebstrap from Debian's mirror
# (no image registry is reachable on the test machines, so the Debian base is made with mmdebstrap).
# Idempotent. Needs root (or sudo) and apt. Writes .tools/podman/containers.conf, the settings podman
# needs on a machine like the CI's, where a container may not raise RLIMIT_NOFILE/NPROC
# (default_ulimits), systemd does not manage the cgroups (cgroupfs) and crun refuses the hybrid
# cgroup layout (runc); scripts/build-images.sh uses it when CONTAINERS_CONF is not set.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v podman >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1 \
    || ! command -v runc >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-container-tools.sh: apt-get not found; install podman (or docker) and mmdebstrap by hand" >&2
    exit 1
  fi
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-container-tools.sh: needs root (or sudo)" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends podman runc mmdebstrap
fi

mkdir -p "$REPO/.tools/podman"
cat > "$REPO/.tools/podman/containers.conf" <<'CONF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
CONF
echo "podman $(podman --version | awk '{print $3}'), mmdebstrap $(mmdebstrap --version | awk '{print $2}'); config $REPO/.tools/podman/containers.conf"
