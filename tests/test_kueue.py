"""The gang/queueing option: spec.queueName puts Kueue's queue-name label on the trainer StatefulSet,
the rollout Deployment and their pods, and a job whose pods Kueue holds is Pending/Queued with its
startup deadline counted from admission. What the test cluster can prove (no Kueue runs there): the
labels on the objects, and the operator's reading of gated pods; Kueue's own admission is its part."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import kmock
import pytest
import yaml

from asyncrl.loader import JobFileError, parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.status import parse_time
from asyncrl.spec import PLURAL
from tests.support.emulated_jobs import JOB, NS, assert_rbac_covers, children_exist, create_job
from tests.support.jobs import JobBuilder
from tests.support.kube_emulator import KubeEmulator
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

REPO = Path(__file__).resolve().parent.parent
QUEUE = "gpu-team"


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


def gated_pod(name: str, component: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {N.LABEL_JOB: "qwen", N.LABEL_COMPONENT: component,
                                                                   N.LABEL_KUEUE_QUEUE: QUEUE}},
            "spec": {"schedulingGates": [{"name": N.KUEUE_ADMISSION_GATE}],
                     "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                            "reason": "SchedulingGated"}]}}


@pytest.mark.slow
async def test_operator_keeps_a_held_job_queued_past_its_startup_deadline(tmp_path: Path):
    async with KubeEmulator() as emu, kmock.Server(emu):
        emu.kubeconfig(tmp_path / "kubeconfig")
        op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log").start()
        try:
            await create_job(emu, JobBuilder.example(queueName=QUEUE, startupDeadlineSeconds=1).named(JOB, NS).doc())
            await poll(lambda: children_exist(emu), what="children", log=op.log)
            for plural, name in (("statefulsets", N.trainer("qwen")), ("deployments", N.rollout("qwen"))):
                assert emu.get(plural, NS, name)["metadata"]["labels"][N.LABEL_KUEUE_QUEUE] == QUEUE
            await emu.put_object("", "v1", "pods", gated_pod("qwen-trainer-0", "trainer"))
            status = lambda: emu.get(PLURAL, NS, "qwen").get("status", {})  # noqa: E731
            await poll(lambda: status().get("reason") == "Queued", what="Queued", log=op.log)
            first = parse_time(status()["startTime"])
            # passes more than the 1 s startup deadline later: still queued (startTime follows), not failed
            await poll(lambda: status().get("phase") == "Failed"
                           or parse_time(status()["startTime"]) - first >= timedelta(seconds=3),
                           what="a pass 3 s later", log=op.log)
            assert (status()["phase"], status()["reason"]) == ("Pending", "Queued"), status()
            assert "held by Kueue" in status()["message"]
        finally:
            await op.stop()
        assert_rbac_covers(emu)
