"""The gang/queueing option: spec.queueName puts Kueue's queue-name label on the trainer StatefulSet,
the rollout Deployment and their pods, and a job whose pods Kueue holds is Pending/Queued with its
startup deadline counted from admission.

On the real control plane, Kueue's pod webhook is played by a MutatingAdmissionPolicy that gives every
pod with the queue-name label Kueue's admission scheduling gate, as Kueue's webhook does: the real
StatefulSet controller makes the trainer pod, the apiserver gates it, the real scheduler leaves it
SchedulingGated, and the operator reads that as Queued. Kueue's own admission (lifting the gate when
its queue has room) is Kueue's part and is not played here."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.status import parse_time
from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.polling import poll_sync
from tests.support.real_operator import crd_fixture, get, job_status, operator_fixture  # noqa: F401

QUEUE = "gpu-team"
NS, JOB = "rl", "qwen"  # the pure tests' job
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def build(**spec) -> list[dict]:
    doc = JobBuilder.example().doc()
    doc["spec"].update(spec)
    return B.build_children(parse_job(doc), B.BuildContext(owner_uid="u", namespace=NS))


def test_queue_label_on_the_gpu_workloads_and_their_pods_only():
    objs = build(queueName=QUEUE)
    labelled = {(o["kind"], o["metadata"]["name"]) for o in objs
                if o["metadata"]["labels"].get(N.LABEL_KUEUE_QUEUE) == QUEUE}
    assert labelled == {("StatefulSet", "qwen25-gsm8k-trainer"), ("Deployment", "qwen25-gsm8k-rollout")}
    for o in objs:
        if (o["kind"], o["metadata"]["name"]) in labelled:
            assert o["spec"]["template"]["metadata"]["labels"][N.LABEL_KUEUE_QUEUE] == QUEUE
            assert o["spec"]["selector"]["matchLabels"].get(N.LABEL_KUEUE_QUEUE) is None, "selectors are immutable"
    unqueued = build()
    assert all(N.LABEL_KUEUE_QUEUE not in yaml.safe_dump(o) for o in unqueued)


@pytest.mark.parametrize("bad", ["GPU", "-a", "a" * 64, "team/queue"])
def test_bad_queue_names_are_refused_with_the_field_path(bad):
    doc = JobBuilder.example().doc()
    doc["spec"]["queueName"] = bad
    with pytest.raises(JobFileError) as err:
        parse_job(doc)
    assert [e.path for e in err.value.errors] == ["spec.queueName"]


@contextlib.contextmanager
def kueue_pod_webhook(cp: ControlPlane, namespace: str) -> Iterator[None]:
    """Kueue's pod webhook, played by a MutatingAdmissionPolicy bound to `namespace`: a pod created with
    the queue-name label gets the admission scheduling gate. Yields once a server-side dry run shows the
    gate (the apiserver loads a new policy a moment after it is stored)."""
    name = f"kueue-gate-{namespace}"[:63]
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
              "metadata": {"name": name},
              "spec": {"failurePolicy": "Fail", "reinvocationPolicy": "Never",
                       "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                               "operations": ["CREATE"], "resources": ["pods"]}]},
                       "matchConditions": [{"name": "queued", "expression":
                                            f"has(object.metadata.labels) && '{N.LABEL_KUEUE_QUEUE}' in "
                                            "object.metadata.labels"}],
                       "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                                      "Object{spec: Object.spec{schedulingGates: [Object.spec.schedulingGates"
                                      f"{{name: '{N.KUEUE_ADMISSION_GATE}'}}]}}}}"}}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
               "metadata": {"name": name},
               "spec": {"policyName": name, "matchResources": {"namespaceSelector": {"matchLabels": {
                   "kubernetes.io/metadata.name": namespace}}}}}
    cp.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [policy, binding]}),
               check=True)
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "probe", "namespace": namespace, "labels": {N.LABEL_KUEUE_QUEUE: QUEUE}},
             "spec": {"containers": [{"name": "c", "image": "x"}]}}

    def gated() -> bool:
        res = cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(probe))
        return res.returncode == 0 and bool(json.loads(res.stdout)["spec"].get("schedulingGates"))

    try:
        poll_sync(gated, timeout=30, what="the stand-in webhook to gate a queued pod")
        yield
    finally:
        cp.kubectl("delete", "mutatingadmissionpolicybinding,mutatingadmissionpolicy", name, "--wait=false")


@pytest.mark.slow
@pytest.mark.cluster
def test_operator_keeps_a_held_job_queued_past_its_startup_deadline(control_plane: ControlPlane, namespace: str,
                                                                      operator: Path):
    cp, job = control_plane, "held"
    with kueue_pod_webhook(cp, namespace):
        doc = JobBuilder.example(queueName=QUEUE, startupDeadlineSeconds=1).doc()
        doc["metadata"] = {"name": job, "namespace": namespace}
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(doc), check=True)

        def status() -> dict:
            return job_status(cp, job, namespace)

        try:
            poll_sync(lambda: status().get("reason") == "Queued", timeout=60, what="Queued")
        except AssertionError:
            raise AssertionError(f"{status()}\noperator log:\n{operator.read_text()[-4000:]}") from None
        for kind, name in (("statefulset", N.trainer(job)), ("deployment", N.rollout(job))):
            assert get(cp, kind, name, "-n", namespace)["metadata"]["labels"][N.LABEL_KUEUE_QUEUE] == QUEUE
        # the pod the real StatefulSet controller made, gated at admission, left so by the real scheduler
        pod = get(cp, "pod", f"{N.trainer(job)}-0", "-n", namespace)
        assert [g["name"] for g in pod["spec"]["schedulingGates"]] == [N.KUEUE_ADMISSION_GATE]
        scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert (scheduled["status"], scheduled["reason"]) == ("False", "SchedulingGated"), scheduled
        first = parse_time(status()["startTime"])
        # passes more than the 1 s startup deadline later: still queued (startTime follows), not failed
        poll_sync(lambda: status().get("phase") == "Failed"
                  or parse_time(status()["startTime"]) - first >= timedelta(seconds=3),
                  timeout=60, what="a pass 3 s later")
        assert (status()["phase"], status()["reason"]) == ("Pending", "Queued"), status()
        assert "held by Kueue" in status()["message"]


def test_a_held_job_says_kueue_holds_it_before_any_other_pod_problem():
    """Found on the real control plane: the managed Redis pod (not queued) was Unschedulable, and the
    Queued job's message named that pod instead of the one Kueue held."""
    from asyncrl.operator import status as S

    spec = parse_job(JobBuilder.example(queueName=QUEUE).named(JOB, NS).doc()).spec
    redis = S.PodProblem("qwen-redis-0", "Unschedulable", "0/1 nodes are available")
    held = S.PodProblem("qwen-trainer-0", S.QUEUED, "held by Kueue until its queue admits the workload")
    obs = S.Observed(rollout_ready=0, trainer_ready=0, redis_ready=0, problems=[redis, held])
    status = S.compute_status(S.JobRef(JOB, NS, 1), spec, {}, obs, T0)
    assert (status["phase"], status["reason"]) == ("Pending", S.QUEUED), status
    assert status["message"] == f"{held.describe()}; {redis.describe()}", status["message"]
