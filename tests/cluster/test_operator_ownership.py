"""Ownership: the operator never patches or adopts an object of a child's name that is not the job's.

A user who may only create AsyncRLJobs could otherwise name a job so that `<job>-redis` is another
team's Service: the operator would rewrite it, make the job its owner, and deleting the job would
delete it. The pure rule (`kube.foreign_holder`) and the status it leads to are checked here
without a cluster; the whole path (the real operator, a real kube-apiserver, a foreign Service) on
the real control plane.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from asyncrl.api.spec import AsyncRLJobSpec
from asyncrl.operator import names as N
from asyncrl.operator import status as S
from asyncrl.operator.kube import foreign_holder
from asyncrl.operator.status import JobRef, Observed
from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.polling import poll_sync
from tests.support.real_operator import (  # noqa: F401
    apply_example_job,
    crd_fixture,
    get,
    job_status,
    operator_fixture,
    wait_for_reason,
)

JOB_UID = "0b5e1c9e-0000-4000-8000-000000000001"


def desired(labels: bool = True) -> dict[str, Any]:
    """A child as the builders make it: the job's labels and controller ownerReference."""
    return {"kind": "Service", "metadata": {
        "name": "victim-redis", "namespace": "rl", "labels": N.job_labels("victim") if labels else {},
        "ownerReferences": [{"apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob", "name": "victim",
                             "uid": JOB_UID, "controller": True, "blockOwnerDeletion": True}]}}


def live(owner_uid: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    refs = [] if owner_uid is None else [{"kind": "Deployment", "name": "team-b", "uid": owner_uid,
                                          "controller": True}]
    return {"metadata": {"name": "victim-redis", "ownerReferences": refs, "labels": labels or {}}}


def test_the_jobs_own_children_are_its_own():
    assert foreign_holder(live(JOB_UID), desired()) is None
    # unowned on purpose (a weights volume that outlives its job), with the job's labels
    assert foreign_holder(live(None, N.job_labels("victim")), desired()) is None
    # a volume the job owned, now to be let go of (deleteWithJob false): the job's uid says it is ours
    unowned = desired()
    del unowned["metadata"]["ownerReferences"]
    assert foreign_holder(live(JOB_UID), unowned, JOB_UID) is None
    edited = {**N.job_labels("victim"), N.LABEL_JOB: "edited"}  # a hand edit of one label: drift, put back
    assert foreign_holder(live(None, edited), unowned) is None
    assert foreign_holder(live("another-uid"), unowned, JOB_UID) is not None


def test_anything_else_is_foreign():
    held = foreign_holder(live("another-uid"), desired())
    assert held is not None and "Deployment team-b" in held
    assert foreign_holder(live(None), desired()) is not None  # unowned, not ours: not adopted
    assert foreign_holder(live(None, N.job_labels("other-job")), desired()) is not None
    assert foreign_holder(live(None, N.job_labels("victim")), desired(labels=False)) is not None


def test_a_conflict_holds_the_job_and_the_deadline_still_ends_it():
    spec = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "startupDeadlineSeconds": 600})
    ref, t0 = JobRef(name="victim", namespace="rl", generation=1), datetime(2026, 1, 1, tzinfo=timezone.utc)
    why = "Service rl/victim-redis exists and is not this job's (controlled by Deployment team-b)"
    s = S.compute_status(ref, spec, {}, Observed(conflict=why), t0)
    assert (s["phase"], s["reason"]) == ("Pending", S.CHILD_CONFLICT) and "victim-redis" in s["message"]
    late = S.compute_status(ref, spec, s, Observed(conflict=why), t0 + timedelta(seconds=601))
    assert (late["phase"], late["reason"]) == ("Failed", "StartupDeadlineExceeded")
    assert "victim-redis" in late["message"]


# ------------------------------------------------------------------ on the real control plane


@pytest.mark.slow
@pytest.mark.cluster
def test_a_job_named_onto_another_teams_service_leaves_it_alone(control_plane: ControlPlane, namespace: str,
                                                                operator: Path):
    cp = control_plane
    # Team B's Service, controlled by its ConfigMap (any owner: what matters is that it is not the job).
    cp.kubectl("create", "configmap", "team-b", "-n", namespace, check=True)
    owner_uid = get(cp, "configmap", "team-b", "-n", namespace)["metadata"]["uid"]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "victim-redis", "namespace": namespace, "labels": {"team": "b"},
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "team-b", "uid": owner_uid,
                             "controller": True}]},
        "spec": {"selector": {"app": "team-b"}, "ports": [{"name": "redis", "port": 6379}]}}
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(service), check=True)
    before = get(cp, "service", "victim-redis", "-n", namespace)

    apply_example_job(cp, "victim", namespace)
    status = wait_for_reason(cp, "victim", namespace, S.CHILD_CONFLICT, operator, timeout=90,
                             what="the job to report the conflict")
    assert status["phase"] == "Pending" and f"Service {namespace}/victim-redis" in status["message"]
    after = get(cp, "service", "victim-redis", "-n", namespace)
    assert after["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
    assert after["metadata"].get("labels") == {"team": "b"} and after["spec"]["selector"] == {"app": "team-b"}
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], "it was written to"
    events = get(cp, "events", "-n", namespace, "--field-selector", "involvedObject.name=victim")["items"]
    assert any(e["reason"] == S.CHILD_CONFLICT and e["type"] == "Warning" for e in events), events
    # Nothing after the conflict was created (it could have referred to the foreign object).
    assert get(cp, "statefulset", N.redis("victim"), "-n", namespace) is None

    # Resolved (team B's Service gone): the operator creates its own and the job goes on.
    cp.kubectl("delete", "service", "victim-redis", "-n", namespace, "--wait=true", check=True)

    def ours() -> dict[str, Any] | None:
        svc = get(cp, "service", "victim-redis", "-n", namespace)
        refs = (svc or {}).get("metadata", {}).get("ownerReferences") or []
        return svc if any(r.get("kind") == "AsyncRLJob" and r.get("name") == "victim" for r in refs) else None

    poll_sync(ours, timeout=90, what="the operator's own Service")

    def moved_on() -> bool:
        return job_status(cp, "victim", namespace).get("reason") not in (None, S.CHILD_CONFLICT)

    poll_sync(moved_on, timeout=60, what="the job to leave ChildConflict")
    assert get(cp, "statefulset", N.redis("victim"), "-n", namespace) is not None
