#!/usr/bin/env bash
# Installs the headless Chromium used by the dashboard browser test (tests/trainer/report/test_dashboard_browser.py).
# Idempotent: does nothing when /usr/bin/chromium already exists. Needs root (or sudo) and apt.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
  echo "chromium already installed: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-browser.sh: apt-get not found; install Chromium at $CHROMIUM by hand" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-browser.sh: needs root (or sudo) to apt-get install chromium" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core

"$CHROMIUM" --version
