"""The real `asyncrl operator` on the real control plane (tests/support/control_plane.py): the CRD
installed once per module, the operator as cluster admin watching the test's namespace, and the chart
installed with the real helm (`chart_release`).

Use: `from tests.support.real_operator import crd_fixture, get, operator_fixture  # noqa: F401`
beside the control plane's own fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.control_plane import ControlPlane, find_tool, start_process
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO
from tests.support.polling import poll_sync

CHART = REPO / "charts" / "asyncrl"


@pytest.fixture(scope="module", name="crd")
def crd_fixture(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "-f", str(REPO / "crds" / "asyncrljob.yaml"), check=True)
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          "crd/asyncrljobs.asyncrl.dev", check=False)
    poll_sync(lambda: control_plane.kubectl("get", "asyncrljobs", "-A").returncode == 0,
              what="the AsyncRLJob API to be served")


def helm(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    """The real helm against the control plane, as its admin."""
    return subprocess.run([str(find_tool("helm")), *args], capture_output=True, text=True,
                          env=cp.env(), timeout=300)


@pytest.fixture(name="chart_release")
def chart_release_fixture(control_plane: ControlPlane, crd: None
                          ) -> Iterator[tuple[str, subprocess.CompletedProcess[str]]]:
    """`helm install asyncrl charts/asyncrl` into a namespace helm creates: (namespace, helm's result);
    uninstalled afterwards (its ClusterRole and ClusterRoleBinding are cluster-wide)."""
    namespace = f"asyncrl-system-{os.urandom(3).hex()}"
    res = helm(control_plane, "install", "asyncrl", str(CHART), "-n", namespace, "--create-namespace")
    try:
        yield namespace, res
    finally:
        helm(control_plane, "uninstall", "asyncrl", "-n", namespace)
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false")


def service_account_kubeconfig(cp: ControlPlane, namespace: str, name: str = "asyncrl") -> tuple[str, Path]:
    """(username, kubeconfig) acting as ServiceAccount `namespace/name` with a real token
    (`kubectl create token`): what RBAC grants it is all it can do."""
    token = cp.kubectl("create", "token", name, "-n", namespace, "--duration", "2h", check=True).stdout.strip()
    return f"system:serviceaccount:{namespace}:{name}", cp.token_kubeconfig(token, name=f"{namespace}-{name}")


def audit_ref(event: dict[str, Any], key: str) -> str | None:
    """A field of an audit event's objectRef (None for a request on no object, e.g. discovery)."""
    return (event.get("objectRef") or {}).get(key)


def audited(cp: ControlPlane, user: str) -> list[dict[str, Any]]:
    """Every finished request `user` made, as the apiserver's audit log has it."""
    events = [json.loads(line) for line in cp.audit_log.read_text().splitlines()]
    return [e for e in events if e["user"]["username"] == user and e.get("stage") == "ResponseComplete"]


def refused_by_rbac(cp: ControlPlane, user: str) -> list[tuple[Any, ...]]:
    """(verb, resource, subresource, namespace) of every request of `user` the apiserver answered 403."""
    return sorted({(e["verb"], audit_ref(e, "resource"), audit_ref(e, "subresource"), audit_ref(e, "namespace"))
                   for e in audited(cp, user) if e["responseStatus"]["code"] == 403}, key=str)


@contextlib.contextmanager
def running_operator(cp: ControlPlane, namespace: str, logs: Path, *extra: str) -> Iterator[Path]:
    """The real `asyncrl operator`, as cluster admin, watching `namespace` (with `extra` arguments);
    yields its log."""
    env = {**cp.env(), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = start_process("operator", [sys.executable, "-m", "asyncrl.cli", "operator", "--namespace", namespace,
                                      "--interval", "1", "--liveness-port", "0", "--metrics-port", "0", "--verbose",
                                      *extra], logs, env=env, cwd=REPO)
    try:
        yield proc.log
    finally:
        proc.stop(grace=15)


@pytest.fixture(name="operator")
def operator_fixture(control_plane: ControlPlane, crd: None, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The real `asyncrl operator`, as cluster admin, watching the test's namespace; yields its log."""
    with running_operator(control_plane, namespace, tmp_path) as log:
        yield log


def get(cp: ControlPlane, *args: str) -> Any:
    """`kubectl get ARGS -o json` as a dict, or None when it fails (e.g. not found)."""
    res = cp.kubectl("get", *args, "-o", "json")
    return json.loads(res.stdout) if res.returncode == 0 else None


def apply_example_job(cp: ControlPlane, name: str, namespace: str) -> None:
    """`kubectl apply` of the example job (tests.support.jobs) as `namespace/name`."""
    job = JobBuilder.example().doc()
    job["metadata"] = {"name": name, "namespace": namespace}
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(job), check=True)


def job_status(cp: ControlPlane, name: str, namespace: str) -> dict[str, Any]:
    """The AsyncRLJob's `.status` as the apiserver has it ({} before the operator's first write)."""
    return (get(cp, "asyncrljob", name, "-n", namespace) or {}).get("status") or {}


def wait_for_reason(cp: ControlPlane, name: str, namespace: str, reason: str, operator_log: Path, *,
                    timeout: float, what: str) -> dict[str, Any]:
    """The job's status once its reason is `reason`; on timeout the failure carries the operator's log."""
    def reached() -> dict[str, Any] | None:
        status = job_status(cp, name, namespace)
        return status if status.get("reason") == reason else None

    try:
        return poll_sync(reached, timeout=timeout, what=what)
    except AssertionError:
        raise AssertionError(f"operator log:\n{operator_log.read_text()[-4000:]}") from None
