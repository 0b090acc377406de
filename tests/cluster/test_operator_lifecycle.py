"""The real kopf operator (`asyncrl operator` subprocess) against a real kube-apiserver with no controllers
(tests/support/bare_apiserver.py): the test writes the workloads' status as their controllers would, and
the apiserver validates, defaults and audits every request. Nothing collects garbage there: that
children go with their job is shown on the full control plane (tests/cluster/test_cluster_e2e.py). A request is
held mid-flight by a slow admission webhook (tests/support/admission_gate.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.api.spec import GROUP, PLURAL, VERSION
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS
from tests.support.admission_gate import AdmissionGate, Rule
from tests.support.bare_apiserver import OPERATOR_USER, BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.operator_jobs import (
    JOB,
    NS,
    assert_rbac_covers,
    children_exist,
    create_job,
    expected_children,
    make_ready,
    patch_job,
    phase,
)
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

pytestmark = pytest.mark.slow


@pytest.fixture
async def operator(api: BareApiserver, tmp_path: Path):
    api.kubeconfig(tmp_path / "kubeconfig")
    op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log").start()
    yield op
    await op.stop()
    assert_rbac_covers(api)


async def test_create_makes_owned_children_and_initializing(api, operator, tmp_path):
    job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="all children", log=operator.log)
    for plural, name in expected_children():
        child = api.get(plural, NS, name)
        refs = child["metadata"].get("ownerReferences")
        if (plural, name) == ("persistentvolumeclaims", N.shared_pvc("qwen")):
            assert not refs, "the weights volume outlives the job (storage.deleteWithJob is off)"
            continue
        assert refs == [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "AsyncRLJob", "name": "qwen",
                         "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"][N.LABEL_JOB] == "qwen"
    await poll(lambda: phase(api) == "Initializing", what="Initializing", log=operator.log)
    status = api.get(PLURAL, NS, "qwen")["status"]
    assert status["observedGeneration"] == 1
    assert [c["type"] for c in status["conditions"]] == [
        "RolloutReady", "TrainerReady", "StreamReady", "WeightsSynced", "Degraded", "Complete", "Failed"]
    assert all(c["lastTransitionTime"] for c in status["conditions"])
    assert status["rollout"]["selector"] == B.rollout_selector("qwen")
    assert not api.get(PLURAL, NS, "qwen")["metadata"].get("finalizers"), "no finalizer is needed"
    # Events are posted after the status write.
    await poll(lambda: any(e.get("reason") in ("Creating", "WaitingForPods") for e in api.all("events", NS)),
                   what="an Event for the phase change", log=operator.log)


async def test_readiness_makes_running(api, operator):
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await make_ready(api)
    await poll(lambda: phase(api) == "Running", what="Running", log=operator.log)
    status = api.get(PLURAL, NS, "qwen")["status"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["RolloutReady"] == conds["TrainerReady"] == conds["StreamReady"] == "True"
    assert status["rollout"]["summary"] == "4/4"


async def test_replicas_update_and_scale_subresource(api, operator):
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    deploy = lambda: api.get("deployments", NS, N.rollout("qwen"))  # noqa: E731
    template_hash = deploy()["spec"]["template"]["metadata"]["annotations"][N.ANNOTATION_CONFIG_HASH]
    await patch_job(api, "qwen", {"spec": {"rollout": {"replicas": 2}}})
    await poll(lambda: deploy()["spec"]["replicas"] == 2, what="Deployment scaled to 2", log=operator.log)
    await patch_job(api, "qwen", {"spec": {"replicas": 3}}, sub="scale")
    assert api.get(PLURAL, NS, "qwen")["spec"]["rollout"]["replicas"] == 3
    await poll(lambda: deploy()["spec"]["replicas"] == 3, what="Deployment scaled to 3", log=operator.log)
    # Scaling is live: the pod template (and so every running pod) is untouched.
    assert deploy()["spec"]["template"]["metadata"]["annotations"][N.ANNOTATION_CONFIG_HASH] == template_hash
    await poll(lambda: api.get(PLURAL, NS, "qwen").get("status", {}).get("observedGeneration") == 3,
                   what="observedGeneration 3", log=operator.log)


async def test_suspend_and_resume(api, operator):
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await make_ready(api)
    await poll(lambda: phase(api) == "Running", what="Running", log=operator.log)
    await patch_job(api, "qwen", {"spec": {"suspend": True}})
    await poll(lambda: phase(api) == "Suspended", what="Suspended", log=operator.log)
    assert api.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 0
    assert api.get("statefulsets", NS, N.trainer("qwen"))["spec"]["replicas"] == 0
    assert api.get("statefulsets", NS, N.redis("qwen"))["spec"]["replicas"] == 1, "Redis is kept"
    assert api.get("persistentvolumeclaims", NS, N.shared_pvc("qwen")), "the volume is kept"
    await api.patch_status("apps", "v1", "deployments", NS, N.rollout("qwen"), {"replicas": 0, "readyReplicas": 0})
    await patch_job(api, "qwen", {"spec": {"suspend": False}})
    await poll(lambda: api.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 4,
                   what="rollout back to 4", log=operator.log)
    assert api.get("statefulsets", NS, N.trainer("qwen"))["spec"]["replicas"] == 1
    await poll(lambda: phase(api) == "Initializing", what="Initializing after resume", log=operator.log)


async def test_an_invalid_job_is_refused_by_the_apiserver_and_the_operator_makes_nothing(api, operator):
    """The CRD's CEL rules refuse it at admission (the operator's own InvalidSpec status, for a spec
    that gets past them, is tests/operator/test_operator_status.py's)."""
    doc = JobBuilder.example().named(JOB, NS).doc()
    doc["spec"]["algorithm"]["minibatches"] = 5  # batchSize 32 is not divisible by 5
    async with api.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=doc) as resp:
        assert resp.status == 422, await resp.text()
        assert "batchSize must be divisible by minibatches" in await resp.text()
    await asyncio.sleep(2.0)  # two operator intervals
    assert api.get(PLURAL, NS, "qwen") is None
    assert not api.all("deployments", NS) and not api.all("statefulsets", NS)
    assert operator.alive


async def test_startup_deadline_reports_pod_reason_and_is_sticky(api, operator):
    await create_job(api, JobBuilder.example(startupDeadlineSeconds=1).named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "qwen-rollout-abc", "namespace": NS,
                        "labels": {N.LABEL_JOB: "qwen", N.LABEL_COMPONENT: "rollout"}},
           "spec": {"containers": [{"name": "engine", "image": "ghcr.io/asyncrl/rollout:0.1.0"}]}}
    await api.put_object("", "v1", "pods", pod)  # as the ReplicaSet controller would, then its kubelet:
    await api.patch_status("", "v1", "pods", NS, "qwen-rollout-abc", {"phase": "Pending", "containerStatuses": [
        {"name": "engine", "ready": False, "restartCount": 0, "image": "ghcr.io/asyncrl/rollout:0.1.0",
         "imageID": "", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]})
    await poll(lambda: phase(api) == "Failed", what="Failed by deadline", log=operator.log)
    status = api.get(PLURAL, NS, "qwen")["status"]
    assert status["reason"] == "StartupDeadlineExceeded"
    assert "ImagePullBackOff" in status["message"] and "qwen-rollout-abc" in status["message"]
    assert status.get("completionTime")
    await poll(lambda: api.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 0,
                   what="GPUs released", log=operator.log)
    await make_ready(api)  # terminal phases are sticky
    generation_seen = len(api.log)
    await poll(lambda: len(api.log) > generation_seen + 20, what="more status passes", log=operator.log)
    assert phase(api) == "Failed"


async def test_restart_mid_reconcile_creates_no_duplicates(api, tmp_path):
    """The operator is killed while its create of a StatefulSet waits at admission (a slow webhook);
    whether or not the apiserver finishes that create, the next operator makes each child once."""
    api.kubeconfig(tmp_path / "kubeconfig")
    log = tmp_path / "operator.log"
    rule = Rule("apps", "statefulsets", ("CREATE",))
    async with AdmissionGate(api.cp, rule, frozenset({OPERATOR_USER})) as gate:
        first = await OperatorProcess(tmp_path / "kubeconfig", log).start()
        try:
            await create_job(api, JobBuilder.example().named(JOB, NS).doc())
            await poll(lambda: gate.held, what="the operator's StatefulSet create held at admission", log=log)
            await first.stop(kill=True)  # killed mid-reconcile, with a create in flight
        finally:
            await first.stop(kill=True)
        gate.release()  # the apiserver goes on with the orphaned request (or drops it with its client)
    second = await OperatorProcess(tmp_path / "kubeconfig", log).start()
    try:
        await poll(lambda: children_exist(api), what="all children after restart", log=log)
        await poll(lambda: phase(api) == "Initializing", what="Initializing", log=log)
    finally:
        await second.stop()
    # every kind the operator can write, not only those it should have written
    kinds = [plural for kind, (_, _, plural) in KINDS.items() if kind not in ("Pod", "Lease", "AsyncRLJob")]
    owned = [(plural, o["metadata"]["name"]) for plural in kinds for o in api.all(plural, NS)]
    assert sorted(owned) == sorted(expected_children()), "exactly the desired children, each once"
    assert_rbac_covers(api)


async def test_delete_relies_on_owner_references(api, operator):
    """No finalizer holds the job and the operator deletes none of its children: the garbage collector
    takes them through their ownerReferences (not running here; the full control plane shows it)."""
    job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    async with api.delete(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/qwen") as resp:
        assert resp.status == 200
    assert api.get(PLURAL, NS, "qwen") is None, "no finalizer holds the job"
    await asyncio.sleep(2.0)  # two operator intervals
    for plural, name in expected_children():
        refs = [r["uid"] for r in api.get(plural, NS, name)["metadata"].get("ownerReferences") or []]
        wanted = [] if (plural, name) == ("persistentvolumeclaims", N.shared_pvc("qwen")) else [job["metadata"]["uid"]]
        assert refs == wanted, (plural, name, refs)  # (the weights volume outlives the job: deleteWithJob off)
    assert not [r for r in api.requests_of() if r.verb == "delete"], "children are the garbage collector's"
    assert operator.alive


async def test_ttl_after_finished_deletes_the_job(api, operator):
    await create_job(api, JobBuilder.example(startupDeadlineSeconds=1, ttlSecondsAfterFinished=0).named(JOB, NS).doc())
    await poll(lambda: api.get(PLURAL, NS, "qwen") is None, what="job deleted after TTL", log=operator.log)
    # the job itself, by the operator; its children follow through ownerReferences (the garbage collector's)
    assert {(r.resource, r.name) for r in api.requests_of() if r.verb == "delete"} == {(PLURAL, "qwen")}
