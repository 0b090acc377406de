"""The operator as the chart's ServiceAccount on the real control plane: after `helm install`, the real
`asyncrl operator` runs with that ServiceAccount's token (not as admin) through a job's life, and the
apiserver's own RBAC refuses none of its requests (the audit log has every request and its answer).

tests/cluster/test_chart_rbac.py compares the chart's grants with what the operator uses (on a bare apiserver,
as cluster admin); this is the real authorizer's word. The job's pods never run here (no node): the
operator's requests are what is checked - create every child, mirror status, correct drift, follow a
spec change, post events, hold its leader Lease, and clean up when the job is deleted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.api import spec as S
from asyncrl.operator import names as N
from tests.support.control_plane import (  # noqa: F401
    ControlPlane,
    control_plane_fixture,
    namespace_fixture,
    start_process,
)
from tests.support.polling import poll_sync
from tests.support.real_operator import (  # noqa: F401
    REPO,
    apply_example_job,
    audit_ref,
    audited,
    chart_release_fixture,
    crd_fixture,
    get,
    refused_by_rbac,
    service_account_kubeconfig,
)

JOB = "rbac"


def test_the_operator_as_the_charts_service_account_is_refused_nothing(control_plane: ControlPlane, chart_release,
                                                                        namespace: str, tmp_path: Path):
    release_ns, installed = chart_release
    assert installed.returncode == 0, installed.stderr
    user, kubeconfig = service_account_kubeconfig(control_plane, release_ns)
    env = {**control_plane.env(kubeconfig), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = start_process("operator-sa", [
        sys.executable, "-m", "asyncrl.cli", "operator", "--namespace", namespace, "--interval", "1",
        "--leader-elect", "--leader-election-namespace", release_ns, "--operator-namespace", release_ns,
        "--liveness-port", "0", "--metrics-port", "0", "--verbose"], tmp_path, env=env, cwd=REPO)

    def refused() -> list[tuple]:
        return refused_by_rbac(control_plane, user)

    def until(cond, timeout: float, what: str) -> None:
        try:
            poll_sync(cond, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{proc.log.read_text()[-3000:]}\n"
                                 f"--- refused by RBAC ---\n{refused()}") from None

    try:
        apply_example_job(control_plane, JOB, namespace)
        children = [("statefulset", N.trainer(JOB)), ("statefulset", N.redis(JOB)), ("deployment", N.rollout(JOB)),
                    ("configmap", N.config_map(JOB)), ("secret", N.redis_secret(JOB)), ("service", N.redis(JOB)),
                    ("service", N.status_service(JOB)), ("persistentvolumeclaim", N.shared_pvc(JOB))]

        def made() -> bool:
            return all(get(control_plane, kind, name, "-n", namespace) for kind, name in children)

        until(made, timeout=120, what=f"the job's children, made as {user}")
        until(lambda: (get(control_plane, S.SINGULAR, JOB, "-n", namespace) or {}).get("status", {}).get("phase"),
                  timeout=60, what="the job's status written")
        # drift: a child deleted is made again; a spec change reaches the children
        uid = get(control_plane, "deployment", N.rollout(JOB), "-n", namespace)["metadata"]["uid"]
        control_plane.kubectl("delete", "deployment", N.rollout(JOB), "-n", namespace, "--wait=false", check=True)
        until(lambda: (get(control_plane, "deployment", N.rollout(JOB), "-n", namespace) or {})
                  .get("metadata", {}).get("uid") not in (None, uid), timeout=60,
                  what="the deleted rollout Deployment made again")
        control_plane.kubectl("patch", S.SINGULAR, JOB, "-n", namespace, "--type=merge",
                              "-p", json.dumps({"spec": {"rollout": {"replicas": 2}}}), check=True)
        until(lambda: (get(control_plane, "deployment", N.rollout(JOB), "-n", namespace) or {})
                  .get("spec", {}).get("replicas") == 2, timeout=60, what="the new replica count")
        control_plane.kubectl("delete", S.SINGULAR, JOB, "-n", namespace, "--wait=true", "--timeout=60s", check=True)
    finally:
        proc.stop(grace=15)

    assert not refused(), f"the chart's RBAC refused the operator: {refused()}\n{proc.log.read_text()[-3000:]}"
    requests = audited(control_plane, user)
    made_as_sa = {(e["verb"], audit_ref(e, "resource"), audit_ref(e, "subresource"))
                  for e in requests if e["responseStatus"]["code"] < 400}
    expected = {("create", "statefulsets", None), ("create", "deployments", None), ("create", "configmaps", None),
                ("create", "secrets", None), ("create", "services", None), ("create", "persistentvolumeclaims", None),
                ("patch", S.PLURAL, "status"), ("create", "events", None), ("watch", S.PLURAL, None)}
    assert expected <= made_as_sa, f"requests not seen as {user}: {sorted(expected - made_as_sa, key=str)}"
    leases = {e["verb"] for e in requests if audit_ref(e, "resource") == "leases"
              and audit_ref(e, "namespace") == release_ns}
    assert leases & {"create", "update", "patch"}, f"no leader Lease written in {release_ns}: {leases}"
