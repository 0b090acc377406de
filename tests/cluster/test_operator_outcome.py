"""How a job ends, with the real operator process against a real kube-apiserver with no controllers
(tests/support/bare_apiserver.py: the test writes what a kubelet and the controllers would) and a real Redis:
the trainer's durable outcome record, trainer restarts and configuration errors (pod statuses
patched in as a kubelet would), activeDeadlineSeconds, a crash-looping rollout (Degraded), and one
writer with optimistic concurrency (409 on a stale resourceVersion; a terminal phase is never left, even
when the operator's status write is held at admission by a slow webhook while another writer ends the job)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.api.outcome import new_outcome, write_outcome_redis
from asyncrl.api.spec import GROUP, PLURAL, VERSION
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.net import free_port
from asyncrl.local.redis_server import LocalRedis
from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from asyncrl.operator.status import fmt_time, now_utc
from asyncrl.transport.connection import connect
from tests.support.admission_gate import AdmissionGate, Rule
from tests.support.bare_apiserver import OPERATOR_USER, BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.operator_jobs import (
    JOB,
    NS,
    assert_rbac_covers,
    children_exist,
    create_job,
    make_ready,
    operator_requests,
    patch_job,
    phase,
)
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

pytestmark = pytest.mark.slow
UNREACHABLE_STATUS = "http://127.0.0.1:1"  # the trainer's /status cannot be reached in these tests
JOB_URL = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/qwen"


async def start_operator(tmp_path: Path, **flags) -> OperatorProcess:
    return await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log",
                                 status_url_template=UNREACHABLE_STATUS, **flags).start()


@pytest.fixture
async def operator(api: BareApiserver, tmp_path: Path):
    api.kubeconfig(tmp_path / "kubeconfig")
    op = await start_operator(tmp_path)
    yield op
    await op.stop()
    assert_rbac_covers(api)


def status(api: BareApiserver, name: str = "qwen") -> dict:
    return (api.get(PLURAL, NS, name) or {}).get("status") or {}


def conditions(api: BareApiserver) -> dict[str, dict]:
    return {c["type"]: c for c in status(api).get("conditions", [])}


def replicas(api: BareApiserver, plural: str, name: str) -> int | None:
    obj = api.get(plural, NS, name)
    return None if obj is None else obj["spec"]["replicas"]


def released(api: BareApiserver, name: str = "qwen") -> bool:
    """Trainer and rollout scaled to zero (the GPUs are given back)."""
    return replicas(api, "deployments", N.rollout(name)) == 0 and replicas(api, "statefulsets", N.trainer(name)) == 0


def trainer_doc(**trainer) -> dict:
    doc = JobBuilder.example().named(JOB, NS).doc()
    doc["spec"]["trainer"].update(trainer)
    return doc


async def put_pod(api: BareApiserver, name: str, component: str, container: str, *, labels: dict | None = None,
                  **container_status) -> None:
    """Play the workload's controller and kubelet: a pod of the job, then its status with one container's."""
    await api.put_object("", "v1", "pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
                     "labels": labels or {N.LABEL_JOB: "qwen", N.LABEL_COMPONENT: component}},
        "spec": {"containers": [{"name": container, "image": "x"}]}})
    cs = {"name": container, "ready": False, "restartCount": 0, "image": "x", "imageID": "", **container_status}
    await api.patch_status("", "v1", "pods", NS, name, {"phase": "Running", "containerStatuses": [cs]})


async def running_job(api: BareApiserver, op: OperatorProcess, doc: dict | None = None) -> dict:
    job = await create_job(api, doc or JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=op.log)
    await make_ready(api)
    await poll(lambda: phase(api) == "Running", what="Running", log=op.log)
    return job


# ----------------------------------------------------------------------------------- the outcome record


async def test_outcome_record_in_managed_redis_succeeds_the_job_without_status_endpoint(api, tmp_path):
    api.kubeconfig(tmp_path / "kubeconfig")
    port = free_port()
    op = await start_operator(tmp_path, redis_url_template=f"redis://:{{password}}@127.0.0.1:{port}/0")
    redis: LocalRedis | None = None
    try:
        job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
        await poll(lambda: children_exist(api), what="children", log=op.log)
        # The job's Redis runs with the password the operator generated into the job's Secret.
        password = secret_value(api.get("secrets", NS, N.redis_secret("qwen")), "password")
        redis = LocalRedis(tmp_path / "redis", port=port, password=password).start()
        await make_ready(api)
        await poll(lambda: phase(api) == "Running", what="Running", log=op.log)

        # The trainer records its outcome (and would stay up; its /status is unreachable here).
        uid = job["metadata"]["uid"]
        client = await connect(redis.url)
        record = new_outcome("qwen", uid, "Succeeded", "MaxStepsReached", step=400, policy_version=400,
                             message="trained 400 steps", weights_path="/shared/weights/v400")
        assert await write_outcome_redis(client, StreamNames.for_job("qwen", uid), record)
        await client.aclose()

        await poll(lambda: phase(api) == "Succeeded", what="Succeeded", log=op.log)
        s = status(api)
        assert (s["reason"], s["message"]) == ("MaxStepsReached", "trained 400 steps")
        assert s["completionTime"]
        assert s["trainer"] == {"step": 400, "policyVersion": 400} and s["progress"]["percent"] == 100.0
        assert conditions(api)["Complete"]["status"] == "True"
        await poll(lambda: released(api), what="trainer and rollout scaled to zero", log=op.log)
        assert replicas(api, "statefulsets", N.redis("qwen")) == 1, "Redis stays until the TTL"
        assert api.get("secrets", NS, N.redis_secret("qwen")), "its Secret too"
    finally:
        await op.stop()
        if redis is not None:
            redis.stop()
    assert_rbac_covers(api)


async def test_outcome_record_in_external_redis_fails_the_job(api, tmp_path, redis_server):
    api.kubeconfig(tmp_path / "kubeconfig")
    op = await start_operator(tmp_path)  # external Redis: the URL comes from the job's Secret
    try:
        await api.put_object("", "v1", "secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "shared-redis", "namespace": NS}, "stringData": {"url": redis_server.url}})
        job = await create_job(api, JobBuilder.example(redis={"mode": "external", "external": {"urlSecret": {
                                                       "name": "shared-redis", "key": "url"}}}).named(JOB, NS).doc())
        await poll(lambda: api.get("statefulsets", NS, N.trainer("qwen")), what="trainer", log=op.log)
        assert api.get("statefulsets", NS, N.redis("qwen")) is None
        uid = job["metadata"]["uid"]
        client = await connect(redis_server.url)
        record = new_outcome("qwen", uid, "Failed", "TooManyBadSteps", step=17, message="5 non-finite losses")
        assert await write_outcome_redis(client, StreamNames.for_job("qwen", uid), record)
        await client.aclose()
        await poll(lambda: phase(api) == "Failed", what="Failed", log=op.log)
        s = status(api)
        assert (s["reason"], s["message"]) == ("TooManyBadSteps", "5 non-finite losses") and s["completionTime"]
        assert conditions(api)["Failed"]["status"] == "True"
        await poll(lambda: released(api), what="GPUs released", log=op.log)
    finally:
        await op.stop()
    assert_rbac_covers(api)


# ----------------------------------------------------------------------------------- failures while running


async def test_trainer_restarts_over_backoff_limit_fail_the_job(api, operator):
    await running_job(api, operator, trainer_doc(backoffLimit=1))
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": "RuntimeError: CUDA error: an illegal memory"}}
    await put_pod(api, "qwen-trainer-0", "trainer", "trainer", restartCount=1, lastState=last)
    # A pass saw the restart (Degraded), and backoffLimit restarts are tolerated: still Running.
    await poll(lambda: conditions(api).get("Degraded", {}).get("status") == "True",
                   what="the restart seen (Degraded)", log=operator.log)
    assert phase(api) == "Running"
    await api.patch_status("", "v1", "pods", NS, "qwen-trainer-0", {"containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 2, "image": "x", "imageID": "", "lastState": last,
         "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]})
    await poll(lambda: phase(api) == "Failed", what="Failed", log=operator.log)
    s = status(api)
    assert s["reason"] == "BackoffLimitExceeded" and s["completionTime"]
    assert "restarted 2 times (backoffLimit 1)" in s["message"]
    assert "last exit code 1 (Error): RuntimeError: CUDA error" in s["message"]
    await poll(lambda: released(api), what="GPUs released", log=operator.log)


async def test_configuration_error_exit_code_fails_at_once(api, operator):
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await put_pod(api, "qwen-trainer-0", "trainer", "trainer", restartCount=1,
                  state={"waiting": {"reason": "CrashLoopBackOff"}},
                  lastState={"terminated": {"exitCode": 78, "reason": "Error",
                                            "message": "spec.dataset.source: hf:nope not found"}})
    await poll(lambda: phase(api) == "Failed", what="Failed", log=operator.log)
    s = status(api)
    assert (s["reason"], s["message"]) == ("ConfigurationError", "spec.dataset.source: hf:nope not found")
    await poll(lambda: released(api), what="GPUs released", log=operator.log)


async def test_active_deadline_fails_the_job(api, operator):
    await create_job(api, JobBuilder.example(activeDeadlineSeconds=2).named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await make_ready(api)
    await poll(lambda: phase(api) == "Failed", what="Failed by activeDeadlineSeconds", log=operator.log)
    s = status(api)
    assert s["reason"] == "DeadlineExceeded" and "2s" in s["message"] and s["completionTime"]
    await poll(lambda: released(api), what="GPUs released", log=operator.log)


async def test_crash_looping_rollout_pod_sets_degraded_without_failing(api, operator):
    await running_job(api, operator)
    await put_pod(api, "qwen-rollout-7d9f-abcde", "rollout", "worker", restartCount=5,
                  state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s"}},
                  lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": "engine not reachable"}})
    await poll(lambda: conditions(api).get("Degraded", {}).get("status") == "True", what="Degraded",
                   log=operator.log)
    d = conditions(api)["Degraded"]
    assert d["reason"] == "CrashLoopBackOff"
    assert "qwen-rollout-7d9f-abcde" in d["message"] and "engine not reachable" in d["message"]
    assert phase(api) == "Running"
    assert replicas(api, "deployments", N.rollout("qwen")) == 4, "a degraded job keeps its GPUs"
    # The pod recovers: Degraded goes back to False.
    await api.patch_status("", "v1", "pods", NS, "qwen-rollout-7d9f-abcde", {"containerStatuses": [
        {"name": "worker", "ready": True, "restartCount": 5, "image": "x", "imageID": "", "state": {"running": {}}}]})
    await poll(lambda: conditions(api)["Degraded"]["status"] == "False", what="no longer Degraded",
                   log=operator.log)


# ----------------------------------------------------------------------------------- one writer


async def test_status_write_with_stale_resource_version_gets_409(api):
    job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    rv = job["metadata"]["resourceVersion"]
    merge = {"Content-Type": "application/merge-patch+json"}

    async def patch(url: str, body: dict) -> int:
        async with api.patch(url, json=body, headers=merge) as resp:
            return resp.status

    precondition = {"metadata": {"resourceVersion": rv}}
    assert await patch(JOB_URL + "/status", {**precondition, "status": {"phase": "Running"}}) == 200
    assert await patch(JOB_URL + "/status", {**precondition, "status": {"phase": "Failed"}}) == 409
    assert await patch(JOB_URL, {"metadata": {"resourceVersion": rv}, "spec": {"suspend": True}}) == 409
    assert status(api)["phase"] == "Running" and not api.get(PLURAL, NS, "qwen")["spec"].get("suspend")
    current = api.get(PLURAL, NS, "qwen")["metadata"]["resourceVersion"]
    assert await patch(JOB_URL, {"metadata": {"resourceVersion": current}, "spec": {"suspend": True}}) == 200
    assert await patch(JOB_URL + "/status", {"status": {"phase": "Pending"}}) == 200, "no precondition, no check"


async def test_terminal_phase_survives_a_racing_status_write(api, operator):
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await poll(lambda: phase(api) == "Initializing", what="Initializing", log=operator.log)

    # Hold the operator's next status write (Running) at admission (a slow webhook)...
    rule = Rule(GROUP, f"{PLURAL}/status", ("UPDATE",), version=VERSION)
    async with AdmissionGate(api.cp, rule, frozenset({OPERATOR_USER})) as gate:
        await make_ready(api)
        await poll(lambda: gate.held, what="the operator's status write in flight", log=operator.log)
        # ...while another writer finishes the job; then let the operator's stale write through.
        finished = fmt_time(now_utc())
        await api.patch_status(GROUP, VERSION, PLURAL, NS, "qwen", {
            "phase": "Failed", "reason": "Preempted", "message": "the cluster took the GPUs back",
            "completionTime": finished})
        gate.release()

    await poll(lambda: released(api), what="GPUs released after the re-read", log=operator.log)
    await poll(lambda: "re-reading" in operator.log.read_text(), what="the conflict in the log", log=operator.log)
    seen = len(api.requests_of())
    await poll(lambda: len(api.requests_of()) > seen + 40, what="more passes", log=operator.log)
    s = status(api)
    assert (s["phase"], s["reason"], s["completionTime"]) == ("Failed", "Preempted", finished)
    assert conditions(api)["Failed"]["status"] == "True", "the operator's later writes keep the terminal phase"
    await make_ready(api)  # children report ready again: still Failed
    await asyncio.sleep(1.0)
    assert phase(api) == "Failed" and released(api)


async def test_spec_change_is_applied_once_by_one_writer(api, operator):
    await running_job(api, operator)
    seen = len(api.requests_of())
    await patch_job(api, "qwen", {"spec": {"rollout": {"replicas": 2}}})
    await poll(lambda: replicas(api, "deployments", N.rollout("qwen")) == 2, what="scaled to 2",
                   log=operator.log)
    await poll(lambda: status(api).get("observedGeneration") == 2, what="observedGeneration 2",
                   log=operator.log)
    await asyncio.sleep(1.0)  # a few more passes
    patches = [r for r in api.requests_of()[seen:] if r.verb == "patch" and r.resource == "deployments"]
    assert len(patches) == 1, f"the Deployment was patched {len(patches)} times for one spec change"
    assert ("asyncrl.dev", PLURAL, "patch") not in operator_requests(api), "kopf writes nothing on the job"


async def test_a_changed_trainer_template_restarts_every_rank_at_once(api, operator):
    """OnDelete + the operator: one stale rank is enough for the whole gang to be deleted together
    (a rolling update would run torchrun's ranks on two templates); an up-to-date gang is left alone."""
    await running_job(api, operator)
    sts = api.get("statefulsets", NS, N.trainer("qwen"))
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"} and sts["spec"]["podManagementPolicy"] == "Parallel"

    async def put_rank(i: int, revision: str) -> None:
        await put_pod(api, f"qwen-trainer-{i}", "trainer", "trainer", ready=True, state={"running": {}},
                      labels={**N.selector_labels("qwen", "trainer"), "controller-revision-hash": revision})

    def ranks() -> list[str]:
        return sorted(p["metadata"]["name"] for p in api.all("pods", NS)
                      if (p["metadata"].get("labels") or {}).get(N.LABEL_COMPONENT) == "trainer")

    await api.patch_status("apps", "v1", "statefulsets", NS, N.trainer("qwen"), {"updateRevision": "qwen-trainer-1"})
    await put_rank(0, "qwen-trainer-1")
    await put_rank(1, "qwen-trainer-1")
    await asyncio.sleep(1.0)  # several passes over an up-to-date gang
    assert ranks() == ["qwen-trainer-0", "qwen-trainer-1"]
    assert not [r for r in api.requests_of() if r.verb == "delete" and r.resource == "pods"]

    # The template changed: the controller's updateRevision moves on, and a new rank already runs it.
    await api.patch_status("apps", "v1", "statefulsets", NS, N.trainer("qwen"), {"updateRevision": "qwen-trainer-2"})
    await put_rank(2, "qwen-trainer-2")
    await poll(lambda: ranks() == [], what="every rank deleted together", log=operator.log)
    assert "restarting all 3 ranks together" in operator.log.read_text()
