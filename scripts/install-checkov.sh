#!/usr/bin/env bash
# Install checkov (the IaC scanner behind scripts/scan.sh) into its own venv: $REPO/.tools/checkov-venv
# (override with CHECKOV_VENV). Idempotent: skips when that venv already runs the pinned version.
#
# Why its own venv: checkov pins exact versions of many packages (boto3, pydantic, networkx,
# jsonschema, ...) that would fight the project's; scan.sh only runs its command line.
# Why pinned: a new checkov release adds checks, which would turn CI red with no change of ours;
# bumping the pin is a reviewed change that updates the accepted list with it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CHECKOV_VENV:-$REPO/.tools/checkov-venv}"
PYTHON="${PYTHON:-python3}"
CHECKOV_VERSION="3.3.30"

# The installed version from its metadata (`checkov --version` takes seconds to import everything).
installed() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("checkov"))' 2>/dev/null; }

# The interpreter the `checkov` script starts: a venv made at another path (a moved or copied
# checkout) keeps the old path there, and its command then fails although the metadata reads fine.
interpreter_exists() { local first; read -r first < "$VENV/bin/checkov" && [[ -x "${first#\#!}" ]]; }

if [[ -x "$VENV/bin/checkov" ]] && interpreter_exists && [[ "$(installed)" == "$CHECKOV_VERSION" ]]; then
  echo "checkov $CHECKOV_VERSION already installed in $VENV"
  exit 0
fi

echo "installing checkov==$CHECKOV_VERSION into $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "checkov==$CHECKOV_VERSION"
got="$(installed)"
[[ "$got" == "$CHECKOV_VERSION" ]] || { echo "checkov in $VENV says '$got', not $CHECKOV_VERSION" >&2; exit 1; }
echo "checkov $got installed in $VENV"
