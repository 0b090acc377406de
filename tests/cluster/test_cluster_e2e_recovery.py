"""End to end on the real control plane, when things go wrong: a trainer crash-looping past its
backoff limit, a SIGKILLed trainer resuming from its checkpoint, and drift (a deleted Deployment, a
hand-scaled one, a deleted Redis Secret mid-run). The real operator process and kubectl; the apiserver,
scheduler and controllers are Kubernetes' own, and `RealCluster` runs every pod as local processes
(tests/support/cluster_e2e.py: the environment, the job and what stands in for the images; the happy
path, the trainer after the end and LoRA are in tests/cluster/test_cluster_e2e.py).

The chart is installed with helm and the operator runs with its ServiceAccount's token, so the
apiserver's own RBAC judges every request (a 403 in the audit log fails the test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
from typing import Any

import pytest

from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from tests.support.cluster_e2e import (  # noqa: F401
    E2E,
    NS,
    alive,
    checkpointed,
    e2e_fixture,
    lineage,
    metrics_steps,
    redis_state,
    released,
    tiny_job,
)
from tests.support.control_plane import control_plane_fixture  # noqa: F401
from tests.support.kube_cluster import Launch, meta
from tests.support.real_operator import chart_release_fixture, crd_fixture  # noqa: F401

pytestmark = pytest.mark.slow


async def test_trainer_crashing_past_backoff_limit_fails_the_job(e2e: E2E) -> None:
    """The trainer exits 3 with a termination message at every start: the kubelet restarts it with
    back-off, the operator counts the restarts in the pod's status and fails the job past backoffLimit."""
    job = "e2e-crash"
    crash = ("import os, sys; open(os.environ['ASYNCRL_TERMINATION_LOG'], 'w').write('RuntimeError: boom');"
             " sys.exit(3)")

    def crashing_trainer(launch: Launch) -> Launch:
        if launch.container == "trainer" and launch.pod.startswith(job) and not launch.probe:
            return dataclasses.replace(launch, argv=["python", "-c", crash])
        return launch

    e2e.hooks.append(crashing_trainer)
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, backoffLimit=1, small_model=True))
    status = await e2e.wait_phase(job, "Failed", timeout=180)
    assert status["reason"] == "BackoffLimitExceeded", status
    restarts = re.search(r"restarted (\d+) times \(backoffLimit 1\)", status["message"])
    assert restarts and int(restarts.group(1)) >= 2, status
    assert "last exit code 3 (Error): RuntimeError: boom" in status["message"], status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Failed"]["status"] == "True" and conditions["Complete"]["status"] == "False"
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero, their pods gone")
    await asyncio.sleep(1.0)
    assert e2e.phase(job) == "Failed" and released(e2e, job), "a failed job stays failed and released"


async def test_sigkilled_trainer_is_restarted_and_trains_each_group_once(e2e: E2E) -> None:
    job, steps, batch = "e2e-kill", 4, 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps, checkpoint_interval=2))
    pod = f"{N.trainer(job)}-0"
    # Killed after step 3: the checkpoint of step 2 is on the volume, step 3 is lost and trained again.
    await e2e.wait(lambda: len(metrics_steps(e2e, job)) >= 3, "3 steps trained", timeout=300)
    assert e2e.phase(job) == "Running"
    killed = e2e.cluster.kill(NS, pod, "trainer")  # torchrun and its worker: the container's process group
    await e2e.wait(lambda: e2e.cluster.container(NS, pod, "trainer").restart_count == 1
                   and e2e.cluster.pid(NS, pod, "trainer"), "the kubelet restarted the trainer")
    status = await e2e.wait_phase(job, "Succeeded")
    assert (status["reason"], status["trainer"]["step"]) == ("MaxStepsReached", steps), status
    assert not alive(killed)
    assert "resumed from" in e2e.cluster.log(NS, pod, "trainer").split(" start #2 ")[1]
    container = e2e.cluster.container(NS, pod, "trainer").status()
    assert container["restartCount"] == 1 and container["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL

    # No group was trained twice in the surviving lineage, and every one of them was acknowledged.
    trained = lineage(e2e, job)
    assert len(trained) == len(set(trained)) == steps * batch, trained
    state = await redis_state(e2e, job)
    assert state["trained"] == set(trained) and state["pending"] == 0, state
    assert metrics_steps(e2e, job) == list(range(1, steps + 1))  # each step's line once (lost ones rewritten)
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero")


# ----------------------------------------------------------------------------------- drift


def uids(pods: list[dict[str, Any]]) -> set[str]:
    return {meta(p)["uid"] for p in pods}


def auth_hash(e2e: E2E, plural: str, name: str) -> str | None:
    obj = e2e.get(plural, name)
    return None if obj is None else obj["spec"]["template"]["metadata"]["annotations"].get(N.ANNOTATION_REDIS_AUTH_HASH)


async def test_drift_is_corrected_and_a_new_redis_secret_rolls_every_pod(e2e: E2E) -> None:
    """Hand edits undone by the operator, the pods they touch remade by the real controllers; a deleted
    Redis Secret mid-run becomes a new password that Redis, rollout and trainer all roll onto (the
    trainer StatefulSet is OnDelete: the operator deletes its pods), with nothing trained twice."""
    job, steps, batch = "e2e-drift", 4, 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps, checkpoint_interval=2))
    await e2e.wait_phase(job, "Running", timeout=300)
    deploy = N.rollout(job)

    # A deleted rollout Deployment is re-created, and its pod comes back (the garbage collector took the
    # old ReplicaSet and pod: the Deployment owned them).
    old = e2e.get("deployments", deploy)
    assert old is not None
    old_pods = uids(e2e.pods(job, "rollout"))
    await e2e.kubectl("delete", "deployment", deploy, "-n", NS)
    await e2e.wait(lambda: (d := e2e.get("deployments", deploy))
                   and d["metadata"]["uid"] != old["metadata"]["uid"], "the Deployment re-created")
    await e2e.wait(lambda: (p := e2e.cluster.ready_pods(NS, {N.LABEL_JOB: job, N.LABEL_COMPONENT: "rollout"}))
                   and not uids(p) & old_pods, "a new rollout pod Ready", timeout=180)

    # A hand-edited replica count is put back, and the extra pods the ReplicaSet made are gone.
    out = await e2e.kubectl("scale", "deployment", deploy, "-n", NS, "--replicas=3")
    assert "scaled" in out
    await e2e.wait(lambda: e2e.replicas("deployments", deploy) == 1 and len(e2e.pods(job, "rollout")) == 1,
                   "replicas corrected to 1, extra pods gone", timeout=120)

    # A deleted Redis Secret, mid-run (steps 1-2 checkpointed and acknowledged in Redis): a new one (new
    # password), and Redis, rollout and trainer roll onto it; Redis keeps its data (AOF on its volume), the
    # trainer resumes from its checkpoint.
    await e2e.wait(lambda: checkpointed(e2e, job), "the checkpoint of step 2", timeout=300)
    assert e2e.phase(job) == "Running"
    secret = e2e.get("secrets", N.redis_secret(job))
    assert secret is not None
    before = {c: uids(e2e.pods(job, c)) for c in ("redis", "rollout", "trainer")}
    hashes = {w: auth_hash(e2e, *w) for w in (("statefulsets", N.redis(job)), ("deployments", deploy),
                                               ("statefulsets", N.trainer(job)))}
    await e2e.kubectl("delete", "secret", N.redis_secret(job), "-n", NS)
    new_secret = await e2e.wait(lambda: (s := e2e.get("secrets", N.redis_secret(job)))
                                and s["metadata"]["uid"] != secret["metadata"]["uid"] and s, "a new Secret")
    assert secret_value(new_secret, "password") != secret_value(secret, "password")
    await e2e.wait(lambda: all(auth_hash(e2e, *w) not in (None, h) for w, h in hashes.items()),
                   "every workload's template carries the new Secret's hash")
    await e2e.wait(lambda: all(not uids(e2e.pods(job, c)) & before[c] for c in before),
                   "every pod rolled", timeout=180)
    status = await e2e.wait_phase(job, "Succeeded")
    assert (status["reason"], status["trainer"]["step"]) == ("MaxStepsReached", steps), status
    assert "resumed from" in e2e.cluster.log(NS, f"{N.trainer(job)}-0", "trainer")
    trained = lineage(e2e, job)
    assert len(trained) == len(set(trained)) == steps * batch, trained
    state = await redis_state(e2e, job)  # through the new Secret: Redis and its clients agree
    assert state["trained"] == set(trained) and state["outcome"].phase == "Succeeded", state
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero")
