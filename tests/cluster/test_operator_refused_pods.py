"""A job whose children cannot create their pods says why, on the real control plane.

A ResourceQuota (or an admission policy) refuses the pods themselves: no pod exists to carry a
reason, only the ReplicaSet controller's `ReplicaFailure` condition on the Deployment. The job's
status and a Warning Event name the Deployment and the apiserver's refusal instead of waiting in
Initializing with no reason. The pure rule (`status.workload_problems`) is checked without a cluster.
"""

from __future__ import annotations

import pytest

from asyncrl.operator import names as N
from asyncrl.operator import status as S
from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.polling import poll_sync
from tests.support.real_operator import (  # noqa: F401
    apply_example_job,
    crd_fixture,
    get,
    operator_fixture,
    wait_for_reason,
)

REFUSAL = 'pods "starved-rollout-6b7c9d-x1" is forbidden: exceeded quota: no-pods, requested: pods=1, used: pods=0'


def deployment(conditions: list[dict]) -> dict:
    return {"kind": "Deployment", "metadata": {"name": "starved-rollout"}, "status": {"conditions": conditions}}


def test_a_deployment_that_cannot_create_pods_is_a_problem_with_the_refusal():
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": REFUSAL}
    [problem] = S.workload_problems([deployment([failure]), {"kind": "StatefulSet", "metadata": {"name": "t"}}])
    assert problem.describe() == f"deployment starved-rollout: FailedCreate: {REFUSAL}"
    # a cleared failure, or other conditions, are no problem
    assert S.workload_problems([deployment([{**failure, "status": "False"}])]) == []
    assert S.workload_problems([deployment([{"type": "Available", "status": "False"}]), deployment([])]) == []


@pytest.mark.slow
@pytest.mark.cluster
def test_a_job_whose_pods_a_quota_refuses_says_why(control_plane: ControlPlane, namespace: str, operator):
    cp = control_plane
    cp.kubectl("create", "quota", "no-pods", "--hard=pods=0", "-n", namespace, check=True)
    poll_sync(lambda: ((get(cp, "resourcequota", "no-pods", "-n", namespace) or {}).get("status") or {}).get("hard"),
              timeout=60, what="the quota counted by its controller (only then is it enforced)")
    apply_example_job(cp, "starved", namespace)
    status = wait_for_reason(cp, "starved", namespace, S.FAILED_CREATE, operator, timeout=120,
                             what="the job to say its pods are refused")
    assert status["phase"] == "Initializing", status
    assert f"deployment {N.rollout('starved')}" in status["message"] and "exceeded quota: no-pods" in status["message"]
    events = get(cp, "events", "-n", namespace, "--field-selector", "involvedObject.name=starved")["items"]
    assert any(e["reason"] == S.FAILED_CREATE and e["type"] == "Warning" and "exceeded quota" in e["message"]
               for e in events), events
