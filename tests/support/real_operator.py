"""The real `asyncrl operator` on the real control plane (tests/support/control_plane.py): the CRD
installed once per module, the operator as cluster admin watching the test's namespace.

Use: `from tests.support.real_operator import crd_fixture, get, operator_fixture  # noqa: F401`
beside the control plane's own fixtures."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.control_plane import ControlPlane, start_process
from tests.support.polling import poll_sync

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", name="crd")
def crd_fixture(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "-f", str(REPO / "crds" / "asyncrljob.yaml"), check=True)
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          "crd/asyncrljobs.asyncrl.dev", check=False)
    poll_sync(lambda: control_plane.kubectl("get", "asyncrljobs", "-A").returncode == 0,
              what="the AsyncRLJob API to be served")


@pytest.fixture(name="operator")
def operator_fixture(control_plane: ControlPlane, crd: None, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The real `asyncrl operator`, as cluster admin, watching the test's namespace; yields its log."""
    env = {**control_plane.env(), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = start_process("operator", [sys.executable, "-m", "asyncrl.cli", "operator", "--namespace", namespace,
                                      "--interval", "1", "--liveness-port", "0", "--metrics-port", "0", "--verbose"],
                         tmp_path, env=env, cwd=REPO)
    try:
        yield proc.log
    finally:
        proc.stop(grace=15)


def get(cp: ControlPlane, *args: str) -> Any:
    """`kubectl get ARGS -o json` as a dict, or None when it fails (e.g. not found)."""
    res = cp.kubectl("get", *args, "-o", "json")
    return json.loads(res.stdout) if res.returncode == 0 else None
