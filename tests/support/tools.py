"""Tools the tests run (helm, kubectl, checkov, the control-plane binaries): found, or the test is
skipped, or failed where CI requires them (ASYNCRL_REQUIRE_CONTROL_PLANE=1, scripts/test.sh)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest

from tests.support.paths import REPO

REQUIRE_ENV = "ASYNCRL_REQUIRE_CONTROL_PLANE"


def unavailable(what: str) -> NoReturn:
    """Skip the test, or fail it where CI requires the real control plane (REQUIRE_ENV=1)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{what} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(what)


def find_tool(name: str) -> Path:
    """A client binary (kubectl, helm): .tools/bin (scripts/install-k8s-tools.sh) first, then PATH."""
    local = REPO / ".tools" / "bin" / name
    if os.access(local, os.X_OK):
        return local
    found = shutil.which(name)
    if not found:
        unavailable(f"{name} not found: run bash scripts/install-k8s-tools.sh")
    return Path(found)
