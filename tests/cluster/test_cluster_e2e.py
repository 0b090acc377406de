"""End to end on the real control plane: the real operator process and kubectl; the apiserver, scheduler
and controllers (ReplicaSets, StatefulSet pods and claims, PV binding, garbage collection, TTL deletion
through the operator) are Kubernetes' own, and `RealCluster` is the one node that runs every pod of a job
as real local processes: the managed Redis (the valkey server the project uses, standing in for the
redis image), the hf engine (`asyncrl engine`) and the rollout worker, and the trainer under torchrun, on
the embedded SmolLM2-135M-Instruct, with probes, restarts and CrashLoopBackOff.

Each test applies its own tiny job (2 groups x 2 samples, 8 new tokens, a few steps) in a namespace of
its own. The chart is installed with helm and the operator runs with its ServiceAccount's token, so the
apiserver's own RBAC judges every request (a 403 in the audit log fails the test). The environment, the
job and what stands in for the images: tests/support/cluster_e2e.py; the failure scenarios (backoff
limit, SIGKILL and resume, drift and Secret rotation): tests/cluster/test_cluster_e2e_recovery.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
import yaml

from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from tests.support.cluster_e2e import (  # noqa: F401
    E2E,
    NS,
    REPO,
    STATUS_PORT,
    PhaseLog,
    alive,
    condensed,
    e2e_fixture,
    lineage,
    metrics_steps,
    pids,
    redis_state,
    released,
    tiny_job,
    unauthenticated_engine_calls,
    unauthenticated_reward_call,
)
from tests.support.control_plane import control_plane_fixture  # noqa: F401
from tests.support.kube_cluster import meta
from tests.support.real_operator import chart_release_fixture, crd_fixture  # noqa: F401

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------------- the happy path


async def test_apply_runs_to_succeeded_releases_and_ttl_deletes_on_the_real_control_plane(e2e: E2E) -> None:
    job, steps = "e2e-happy", 3
    await e2e.start_operator(job)
    with PhaseLog(e2e, job) as phases:
        async with e2e.transcript() as transcript:
            out = await e2e.apply(tiny_job(job, max_steps=steps, ttl=10, reward_service=True, episode=True))
            assert out.strip() == f"asyncrljob.asyncrl.dev/{job} created"
            await e2e.wait_phase(job, "Running", timeout=300)
            running = pids(e2e, job)
            assert sorted(k.split("/")[1] for k in running) == ["engine", "engine-proxy", "redis", "reward", "trainer",
                                                                "worker"], running
            refused = await unauthenticated_engine_calls(e2e, job)
            reward_pod, reward_refused = await unauthenticated_reward_call(e2e, job)
            snapshot = await e2e.kubectl("get", "pods,statefulsets,deployments,pvc", "-n", NS, "-o", "wide")
            guards = await e2e.kubectl("get", "networkpolicies,secrets", "-n", NS)
            status = await e2e.wait_phase(job, "Succeeded")
            shared = e2e.cluster.claim_path(NS, N.shared_pvc(job))
            await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero, their pods gone")
            await e2e.wait(lambda: e2e.job(job) is None, "the job deleted by ttlSecondsAfterFinished", timeout=60)
            await e2e.wait(lambda: not e2e.get("statefulsets", N.redis(job)), "its children collected", timeout=60)
            await e2e.wait(lambda: not e2e.get("persistentvolumeclaims", f"data-{N.redis(job)}-0"),
                           "Redis's claim collected", timeout=60)
            await asyncio.sleep(1.0)  # the poller sees it gone
    deleted = await e2e.kubectl("get", "all,pvc", "-n", NS)
    version = await e2e.kubectl("version")
    print(f"\n$ kubectl version\n{version}\nphases: {phases.seen}\n{condensed(transcript, job)}\n"
          f"--- Running ---\n{snapshot}\n"
          f"--- the engine without the job's API key ---\n{refused}\n--- its guards ---\n{guards}\n"
          f"--- deleted (ttlSecondsAfterFinished) ---\n{deleted}")

    assert [p for p in phases.seen if p in ("Initializing", "Running", "Succeeded")] == \
        ["Initializing", "Running", "Succeeded"], phases.seen
    assert (status["reason"], status["trainer"]["step"], status["trainer"]["policyVersion"]) == \
        ("MaxStepsReached", steps, steps), status
    # pods made by the real controllers, bound to the process kubelet's node by the real scheduler
    assert e2e.cluster.node_name in snapshot and "Bound" in snapshot, snapshot
    pinned = re.search(r"k8s.io/kubernetes (v\S+)", (REPO / "tools" / "k8s" / "go.mod").read_text())
    assert pinned and f"Server Version: {pinned.group(1)}" in version, version  # the apiserver built here
    assert "reward service" in e2e.cluster.log(NS, reward_pod, "reward"), reward_pod
    assert reward_refused == 401, reward_refused
    # Without the key the engine proxy refused a weight update (401) while training, with it, went on.
    assert [line.split()[-1] for line in refused.splitlines()] == ["401", "401", "401", "200"], refused
    policies = [N.rollout(job), N.trainer(job), N.redis_network_policy(job)]
    for guard in [*(f"networkpolicy.networking.k8s.io/{p}" for p in policies), f"secret/{N.engine_secret(job)}"]:
        assert guard in guards, guards
    # the printer columns (the real CRD's) showed the real trainer's figures while it ran
    rows = transcript.rows(job)
    live = [r for r in rows if r[1] == "Running" and len(r) == 8 and r[2].isdigit() and int(r[2]) >= 1]
    assert live, f"no Running row with the trainer's step:\n{condensed(transcript, job)}"
    assert next(r for r in rows if r[1] == "Succeeded")[2:4] == [str(steps), str(steps)]
    # every process of the job is gone; the garbage collector took every object the job owned ...
    assert not any(alive(pid) for pid in running.values())
    assert not e2e.pods(job) and not e2e.cluster.alive_processes()
    owned = [("configmaps", N.config_map(job)), ("secrets", N.redis_secret(job)),
             ("secrets", N.status_secret(job)), ("secrets", N.engine_secret(job)), ("services", N.redis(job)),
             ("services", N.trainer(job)), ("services", N.status_service(job)), ("statefulsets", N.redis(job)),
             ("statefulsets", N.trainer(job)), ("deployments", N.rollout(job)),
             ("networkpolicies", N.redis_network_policy(job)), ("persistentvolumeclaims", f"data-{N.redis(job)}-0"),
             ("deployments", N.reward(job)), ("services", N.reward(job)), ("networkpolicies", N.reward(job))]
    await e2e.wait(lambda: [o for o in owned if e2e.get(*o)] == [], "the job's children collected", timeout=60)
    # ... but the weights volume (not owned by default) stays, with the final weights on it
    assert e2e.get("persistentvolumeclaims", N.shared_pvc(job)) is not None
    assert (shared / "weights" / f"v{steps}" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (shared / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "event" not in m] == list(range(1, steps + 1))
    assert all(m["turns_mean"] == 2.0 and m["tool_calls"] == 4 for m in metrics if "event" not in m), metrics


# ----------------------------------------------------------------------------------- a trainer after the end


async def test_trainer_started_after_succeeded_serves_the_outcome_and_trains_nothing(e2e: E2E) -> None:
    job, steps = "e2e-after", 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps, small_model=True))
    await e2e.wait_phase(job, "Succeeded")
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero")
    shared = e2e.shared(job)

    def files() -> dict[str, Any]:
        return {"weights": sorted(p.name for p in (shared / "weights").iterdir()),
                "checkpoints": sorted(p.name for p in (shared / "checkpoints").iterdir()),
                "metrics": (shared / "runs" / "metrics.jsonl").read_text()}

    before, redis_before = files(), await redis_state(e2e, job)
    assert f"v{steps}" in before["weights"] and redis_before["outcome"].phase == "Succeeded"

    # One more trainer pod, as the StatefulSet would run it (its template, its name: the same Redis
    # consumer), e.g. a restart that raced the release. Not under the StatefulSet's selector: the real
    # StatefulSet controller adopts a pod its selector matches and deletes it at 0 replicas.
    sts = e2e.get("statefulsets", N.trainer(job))
    assert sts is not None
    pod_name = f"{N.trainer(job)}-0"
    template = sts["spec"]["template"]
    labels = {k: v for k, v in template["metadata"]["labels"].items() if k != N.LABEL_COMPONENT}
    assert not set(sts["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "namespace": NS, "labels": labels},
           "spec": {**template["spec"], "hostname": pod_name, "subdomain": N.trainer(job)}}
    path = e2e.tmp / "trainer-pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    assert "created" in await e2e.kubectl("apply", "-f", str(path))
    await e2e.wait(lambda: "serving it without loading the model" in e2e.cluster.log(NS, pod_name, "trainer"),
                   "the new trainer finds the recorded outcome", timeout=120)
    port = e2e.cluster.host_port(NS, pod_name, STATUS_PORT)

    # The trainer requires the job's bearer token (from the operator's Secret, through its env).
    token = secret_value(e2e.get("secrets", N.status_secret(job)), "token")
    assert token

    async def get_status(headers: dict[str, str]) -> tuple[int, Any] | None:
        import aiohttp

        try:
            async with aiohttp.ClientSession() as http, \
                    http.get(f"http://127.0.0.1:{port}/status", headers=headers) as resp:
                return resp.status, await resp.json()
        except aiohttp.ClientError:
            return None

    async def report() -> dict[str, Any] | None:
        got = await get_status({"Authorization": f"Bearer {token}"})
        return got[1] if got and got[0] == 200 else None

    served = await e2e.wait(report, "its /status answers")
    unauthenticated = await get_status({})
    assert unauthenticated is not None and unauthenticated[0] == 401, unauthenticated
    assert (served["phase"], served["step"], served["outcome_restored"]) == ("Succeeded", steps, True), served
    await asyncio.sleep(2.0)  # it would have published or trained by now if it were going to
    assert files() == before, "the trainer started after the end touched the weights volume"
    redis_after = await redis_state(e2e, job)
    assert (redis_after["trained"], redis_after["versions"]) == (redis_before["trained"], redis_before["versions"])
    assert e2e.cluster.container(NS, pod_name, "trainer").restart_count == 0
    assert e2e.phase(job) == "Succeeded" and e2e.replicas("deployments", N.rollout(job)) == 0
    await e2e.kubectl("delete", "pod", pod_name, "-n", NS, "--wait=false")
    await e2e.wait(lambda: not e2e.get("pods", pod_name), "the extra trainer pod gone")


# ----------------------------------------------------------------------------------- a stall


async def test_a_job_whose_verifier_always_fails_says_why_and_fails_at_its_progress_deadline(e2e: E2E) -> None:
    """Every group's reward fails (a plug-in verifier that always raises, imported by the rollout
    worker from PYTHONPATH): within stallAfterSeconds the job's Degraded condition and its reason
    (`kubectl get -o wide`'s REASON column) say RewardFailures, with the count and the verifier's
    error; at progressDeadlineSeconds the operator ends the job Failed with ProgressDeadlineExceeded."""
    job, deadline = "e2e-stall", 60
    await e2e.start_operator(job)
    doc = tiny_job(job, small_model=True, stallAfterSeconds=5, progressDeadlineSeconds=deadline)
    doc["spec"]["reward"]["function"] = "tests.support.reward_services:always_failing"
    doc["spec"]["rollout"]["podTemplate"] = {"env": [{"name": "PYTHONPATH", "value": str(REPO)}]}
    await e2e.apply(doc)

    def stalled() -> dict[str, Any] | None:
        status = e2e.status(job)
        degraded = {c["type"]: c for c in status.get("conditions", [])}.get("Degraded") or {}
        return status if degraded.get("reason") == "RewardFailures" and status.get("phase") == "Running" else None

    status = await e2e.wait(stalled, "Degraded RewardFailures while Running", timeout=deadline + 60)
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and status["reason"] == "RewardFailures", status
    assert re.search(r"^no group accepted for training since \S+Z: \d+ groups dropped because their reward could "
                     r"not be computed \(last error: prompt .*RuntimeError: verifier sandbox unreachable",
                     degraded["message"]), degraded
    wide = (await e2e.kubectl("get", "asyncrljobs", job, "-n", NS, "-o", "wide")).splitlines()
    assert wide[0].split()[-1] == "REASON" and wide[1].split()[-1] in ("RewardFailures", "ProgressDeadlineExceeded")
    failed = await e2e.wait_phase(job, "Failed", timeout=deadline + 120)
    assert failed["reason"] == "ProgressDeadlineExceeded", failed
    assert re.search(rf"^no training step for \d+s \(progressDeadlineSeconds={deadline}\), no group accepted for "
                     r"\d+s: \d+ groups dropped because their reward could not be computed", failed["message"]), failed
    assert failed["trainer"]["step"] == 0 and failed["recovery"]["rewardFailures"] > 0, failed


# ----------------------------------------------------------------------------------- LoRA


async def test_a_lora_job_hot_loads_adapters_survives_kills_and_succeeds(e2e: E2E) -> None:
    """spec.trainer.lora with the hf engine: every version on the weights volume is an adapter
    directory; the engine, killed, restarts on its base model and is caught up to the current adapter
    before its worker generates again; the trainer, killed, resumes from its adapter-only checkpoint;
    the job succeeds with each group trained once."""
    from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    job, steps, batch = "e2e-lora", 4, 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps, checkpoint_interval=2, lora={"rank": 4, "alpha": 8}))
    (rollout_pod,) = [meta(p)["name"] for p in await e2e.wait(lambda: e2e.pods(job, "rollout"), "a rollout pod")]
    await e2e.wait(lambda: len(metrics_steps(e2e, job)) >= 1, "a step trained", timeout=300)
    e2e.cluster.kill(NS, rollout_pod, "engine")
    await e2e.wait(lambda: e2e.cluster.container(NS, rollout_pod, "engine").restart_count == 1,
                   "the kubelet restarted the engine")
    await e2e.wait(lambda: len(metrics_steps(e2e, job)) >= 3, "3 steps trained", timeout=300)
    trainer_pod = f"{N.trainer(job)}-0"
    e2e.cluster.kill(NS, trainer_pod, "trainer")
    status = await e2e.wait_phase(job, "Succeeded")
    assert (status["reason"], status["trainer"]["step"]) == ("MaxStepsReached", steps), status
    assert "resumed from" in e2e.cluster.log(NS, trainer_pod, "trainer").split(" start #2 ")[1]

    versions = sorted((e2e.shared(job) / "weights").glob("v*"))
    assert versions and all(sorted(p.name for p in v.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
                            for v in versions), versions
    restarted = e2e.cluster.log(NS, rollout_pod, "engine").split(" start #2 ")[1]
    assert "asyncrl engine: loaded " in restarted, "catch-up loaded the current adapter into the restarted engine"
    trained = lineage(e2e, job)
    assert len(trained) == len(set(trained)) == steps * batch, trained
    labels = [label for line in (e2e.shared(job) / "checkpoints" / "trained-groups.jsonl").read_text().splitlines()
              for label in json.loads(line)["labels"]]
    assert any(int(label.split("@")[0]) > 0 for label in labels), labels
    state = await redis_state(e2e, job)
    assert state["trained"] == set(trained) and state["pending"] == 0, state
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero")
