#!/usr/bin/env bash
# The static checks scripts/test.sh runs before pytest (seconds): lint, types, dead code (80%
# confidence) and the import layers (import-linter contracts in pyproject.toml). Needs .venv
# (bash scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "static-checks: ruff"
.venv/bin/ruff check .
echo "static-checks: mypy"
.venv/bin/mypy
echo "static-checks: vulture"
.venv/bin/vulture
echo "static-checks: import layers (import-linter)"
.venv/bin/python scripts/check_imports.py
