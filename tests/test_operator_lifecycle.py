"""The real kopf operator (`asyncrl operator` subprocess) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kmock
import pytest

from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS
from asyncrl.spec import GROUP, PLURAL, VERSION
from tests.support.emulated_jobs import (
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
from tests.support.jobs import JobBuilder
from tests.support.kube_emulator import KubeEmulator
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

pytestmark = pytest.mark.slow


@pytest.fixture
async def emu(tmp_path: Path):
    async with KubeEmulator() as e, kmock.Server(e):
        e.kubeconfig(tmp_path / "kubeconfig")
        yield e


@pytest.fixture
async def operator(emu: KubeEmulator, tmp_path: Path):
    op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log").start()
    yield op
    await op.stop()
    assert_rbac_covers(emu)


async def test_create_makes_owned_children_and_initializing(emu, operator, tmp_path):
    job = await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="all children", log=operator.log)
    for plural, name in expected_children():
        child = emu.get(plural, NS, name)
        refs = child["metadata"].get("ownerReferences")
        if (plural, name) == ("persistentvolumeclaims", N.shared_pvc("qwen")):
            assert not refs, "the weights volume outlives the job (storage.deleteWithJob is off)"
            continue
        assert refs == [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "AsyncRLJob", "name": "qwen",
                         "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"][N.LABEL_JOB] == "qwen"
    await poll(lambda: phase(emu) == "Initializing", what="Initializing", log=operator.log)
    status = emu.get(PLURAL, NS, "qwen")["status"]
    assert status["observedGeneration"] == 1
    assert [c["type"] for c in status["conditions"]] == [
        "RolloutReady", "TrainerReady", "StreamReady", "WeightsSynced", "Degraded", "Complete", "Failed"]
    assert all(c["lastTransitionTime"] for c in status["conditions"])
    assert status["rollout"]["selector"] == B.rollout_selector("qwen")
    assert not emu.get(PLURAL, NS, "qwen")["metadata"].get("finalizers"), "no finalizer is needed"
    # Events are posted after the status write.
    await poll(lambda: any(e.get("reason") in ("Creating", "WaitingForPods") for e in emu.all("events", NS)),
                   what="an Event for the phase change", log=operator.log)


async def test_readiness_makes_running(emu, operator):
    await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="children", log=operator.log)
    await make_ready(emu)
    await poll(lambda: phase(emu) == "Running", what="Running", log=operator.log)
    status = emu.get(PLURAL, NS, "qwen")["status"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["RolloutReady"] == conds["TrainerReady"] == conds["StreamReady"] == "True"
    assert status["rollout"]["summary"] == "4/4"


async def test_replicas_update_and_scale_subresource(emu, operator):
    await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="children", log=operator.log)
    deploy = lambda: emu.get("deployments", NS, N.rollout("qwen"))  # noqa: E731
    template_hash = deploy()["spec"]["template"]["metadata"]["annotations"][N.ANNOTATION_CONFIG_HASH]
    await patch_job(emu, "qwen", {"spec": {"rollout": {"replicas": 2}}})
    await poll(lambda: deploy()["spec"]["replicas"] == 2, what="Deployment scaled to 2", log=operator.log)
    await patch_job(emu, "qwen", {"spec": {"replicas": 3}}, sub="scale")
    assert emu.get(PLURAL, NS, "qwen")["spec"]["rollout"]["replicas"] == 3
    await poll(lambda: deploy()["spec"]["replicas"] == 3, what="Deployment scaled to 3", log=operator.log)
    # Scaling is live: the pod template (and so every running pod) is untouched.
    assert deploy()["spec"]["template"]["metadata"]["annotations"][N.ANNOTATION_CONFIG_HASH] == template_hash
    await poll(lambda: emu.get(PLURAL, NS, "qwen").get("status", {}).get("observedGeneration") == 3,
                   what="observedGeneration 3", log=operator.log)


async def test_suspend_and_resume(emu, operator):
    await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="children", log=operator.log)
    await make_ready(emu)
    await poll(lambda: phase(emu) == "Running", what="Running", log=operator.log)
    await patch_job(emu, "qwen", {"spec": {"suspend": True}})
    await poll(lambda: phase(emu) == "Suspended", what="Suspended", log=operator.log)
    assert emu.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 0
    assert emu.get("statefulsets", NS, N.trainer("qwen"))["spec"]["replicas"] == 0
    assert emu.get("statefulsets", NS, N.redis("qwen"))["spec"]["replicas"] == 1, "Redis is kept"
    assert emu.get("persistentvolumeclaims", NS, N.shared_pvc("qwen")), "the volume is kept"
    await emu.patch_status("apps", "v1", "deployments", NS, N.rollout("qwen"), {"replicas": 0, "readyReplicas": 0})
    await patch_job(emu, "qwen", {"spec": {"suspend": False}})
    await poll(lambda: emu.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 4,
                   what="rollout back to 4", log=operator.log)
    assert emu.get("statefulsets", NS, N.trainer("qwen"))["spec"]["replicas"] == 1
    await poll(lambda: phase(emu) == "Initializing", what="Initializing after resume", log=operator.log)


async def test_invalid_object_fails_with_message(emu, operator):
    doc = JobBuilder.example().named(JOB, NS).doc()
    doc["spec"]["algorithm"]["minibatches"] = 5  # batchSize 32 is not divisible by 5
    await create_job(emu, doc)
    await poll(lambda: phase(emu) == "Failed", what="Failed", log=operator.log)
    status = emu.get(PLURAL, NS, "qwen")["status"]
    assert status["reason"] == "InvalidSpec"
    assert "batchSize (32) must be divisible by minibatches (5)" in status["message"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Failed"] == "True"
    assert not emu.all("deployments", NS) and not emu.all("statefulsets", NS)
    assert operator.alive, "an invalid object must not crash the operator"


async def test_startup_deadline_reports_pod_reason_and_is_sticky(emu, operator):
    await create_job(emu, JobBuilder.example(startupDeadlineSeconds=1).named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="children", log=operator.log)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "qwen-rollout-abc", "namespace": NS,
                        "labels": {N.LABEL_JOB: "qwen", N.LABEL_COMPONENT: "rollout"}},
           "status": {"phase": "Pending", "containerStatuses": [
               {"name": "engine", "ready": False,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}}
    await emu.put_object("", "v1", "pods", pod)
    await poll(lambda: phase(emu) == "Failed", what="Failed by deadline", log=operator.log)
    status = emu.get(PLURAL, NS, "qwen")["status"]
    assert status["reason"] == "StartupDeadlineExceeded"
    assert "ImagePullBackOff" in status["message"] and "qwen-rollout-abc" in status["message"]
    assert status.get("completionTime")
    await poll(lambda: emu.get("deployments", NS, N.rollout("qwen"))["spec"]["replicas"] == 0,
                   what="GPUs released", log=operator.log)
    await make_ready(emu)  # terminal phases are sticky
    generation_seen = len(emu.log)
    await poll(lambda: len(emu.log) > generation_seen + 20, what="more status passes", log=operator.log)
    assert phase(emu) == "Failed"


async def test_restart_mid_reconcile_creates_no_duplicates(emu, tmp_path):
    gate = asyncio.Event()
    emu.gates[("create", "statefulsets")] = gate
    log = tmp_path / "operator.log"
    first = await OperatorProcess(tmp_path / "kubeconfig", log).start()
    try:
        await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
        await poll(lambda: any(r.verb == "create" and r.resource == "statefulsets" for r in emu.log),
                       what="the operator blocked creating a StatefulSet", log=log)
        await first.stop(kill=True)  # killed mid-reconcile, with a create in flight
    finally:
        await first.stop(kill=True)
    gate.set()  # the API server finishes the orphaned request after the client died
    del emu.gates[("create", "statefulsets")]
    second = await OperatorProcess(tmp_path / "kubeconfig", log).start()
    try:
        await poll(lambda: children_exist(emu), what="all children after restart", log=log)
        await poll(lambda: phase(emu) == "Initializing", what="Initializing", log=log)
    finally:
        await second.stop()
    # every kind the operator can write, not only those it should have written
    kinds = [plural for kind, (_, _, plural) in KINDS.items() if kind not in ("Pod", "Lease", "AsyncRLJob")]
    owned = [(plural, o["metadata"]["name"]) for plural in kinds for o in emu.all(plural, NS)]
    assert sorted(owned) == sorted(expected_children()), "exactly the desired children, each once"
    assert_rbac_covers(emu)


async def test_delete_relies_on_owner_references(emu, operator):
    await create_job(emu, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(emu), what="children", log=operator.log)
    async with emu.delete(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/qwen") as resp:
        assert resp.status == 200
    assert emu.get(PLURAL, NS, "qwen") is None, "no finalizer holds the job"
    for plural, name in expected_children():
        if (plural, name) == ("persistentvolumeclaims", N.shared_pvc("qwen")):
            assert emu.get(plural, NS, name), "the weights volume outlives the job (storage.deleteWithJob is off)"
            continue
        assert emu.get(plural, NS, name) is None, f"{plural}/{name} was not garbage-collected"
    assert operator.alive


async def test_ttl_after_finished_deletes_the_job(emu, operator):
    await create_job(emu, JobBuilder.example(startupDeadlineSeconds=1, ttlSecondsAfterFinished=0).named(JOB, NS).doc())
    await poll(lambda: emu.get(PLURAL, NS, "qwen") is None, what="job deleted after TTL", log=operator.log)
    assert any(r.verb == "delete" and r.resource == PLURAL for r in emu.log)
    assert emu.get("deployments", NS, N.rollout("qwen")) is None, "children follow through ownerReferences"
