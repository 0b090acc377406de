"""End to end on the test cluster (issue 18, part 6): the real operator process, the real kubectl, and
`KubeCluster` running every pod of a job as real local processes: the managed Redis (the valkey server the
project uses, standing in for the redis image), the hf engine (`asyncrl engine`) and the rollout worker, and
the trainer under torchrun, on the embedded SmolLM2-135M-Instruct, with probes, restarts and CrashLoopBackOff.

Each test applies its own tiny job (2 groups x 2 samples, 8 new tokens, a few steps) in a cluster of its own.
The operator runs outside the cluster, as it would on a laptop against a real one: it reaches the job's
status endpoint and Redis through the cluster's Service proxies (`--status-url-template`,
`--redis-url-template`, what `kubectl port-forward` would give it), so one operator process serves one job.

What stands in for the images (tests/support/kube_cluster/ maps paths, Service names and declared ports itself):
the redis image's `redis-server`/`redis-cli` are the valkey binaries `asyncrl.local_redis` uses (a bin dir
on the pods' PATH); the trainer's status port, which it reads from the job file, is given as
`--status-port <host port>` (the hook); the node's model cache (`ASYNCRL_CACHE`) plays the pre-pulled
image, so the embedded GGUF is not converted again in every pod.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from tests.support.cluster_e2e import (
    E2E,
    KUBECTL,
    NS,
    REPO,
    STATUS_PORT,
    PhaseLog,
    alive,
    checkpointed,
    condensed,
    lineage,
    metrics_steps,
    pids,
    redis_state,
    released,
    tiny_job,
    unauthenticated_engine_calls,
    unauthenticated_reward_call,
)
from tests.support.emulated_jobs import assert_rbac_covers
from tests.support.kube_cluster import meta
from tests.support.kube_emulator import KubeEmulator

pytestmark = pytest.mark.slow


@pytest.fixture
async def e2e(tmp_path: Path):
    if not KUBECTL.exists():  # as tests/test_operator_kubectl.py: fetched from the PyPI wheel
        subprocess.run([str(REPO / "scripts" / "install-k8s-tools.sh")], check=True)
    async with KubeEmulator() as emu, kmock.Server(emu):
        env = E2E(emu, tmp_path)
        await env.cluster.start()
        try:
            yield env
        finally:
            for op in env.operators:
                await op.stop()
            await env.cluster.stop()
        assert not env.cluster.alive_processes(), f"container processes left behind: {env.cluster.alive_processes()}"
        assert not env.cluster.errors, "\n".join(env.cluster.errors)
        assert_rbac_covers(emu)


# ----------------------------------------------------------------------------------- 1. the happy path


async def test_apply_runs_to_succeeded_releases_and_ttl_deletes(e2e: E2E) -> None:
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
            snapshot = await e2e.kubectl("get", "pods,statefulsets,deployments", "-n", NS)
            guards = await e2e.kubectl("get", "networkpolicies,secrets", "-n", NS)
            status = await e2e.wait_phase(job, "Succeeded")
            await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero, their pods gone")
            finished = await e2e.kubectl("get", "pods,statefulsets,deployments", "-n", NS)
            await e2e.wait(lambda: e2e.job(job) is None, "the job deleted by ttlSecondsAfterFinished", timeout=60)
            await e2e.wait(lambda: not e2e.emu.get("statefulsets", NS, N.redis(job)), "its children collected")
            await asyncio.sleep(1.0)  # the poller sees it gone
    deleted = await e2e.kubectl("get", "all,pvc", "-n", NS)
    print(f"\nphases: {phases.seen}\n{condensed(transcript, job)}\n--- Running ---\n{snapshot}\n"
          f"--- the engine without the job's API key ---\n{refused}\n--- its guards ---\n{guards}\n"
          f"--- Succeeded ---\n{finished}\n--- deleted (ttlSecondsAfterFinished) ---\n{deleted}")

    assert [p for p in phases.seen if p in ("Initializing", "Running", "Succeeded")] == \
        ["Initializing", "Running", "Succeeded"], phases.seen
    assert (status["reason"], status["trainer"]["step"], status["trainer"]["policyVersion"]) == \
        ("MaxStepsReached", steps, steps), status
    # Every reward came from the job's reward service (onError drop: had it failed, no group would have
    # been trained and the job would not have reached its steps); without the key it refuses to score.
    assert "reward service" in e2e.cluster.log(NS, reward_pod, "reward"), reward_pod
    assert reward_refused == 401, reward_refused
    # Without the key the engine proxy refused a weight update (401) while training, with it, went on.
    assert [line.split()[-1] for line in refused.splitlines()] == ["401", "401", "401", "200"], refused
    policies = [N.rollout(job), N.trainer(job), N.redis_network_policy(job)]
    for guard in [*(f"networkpolicy.networking.k8s.io/{p}" for p in policies), f"secret/{N.engine_secret(job)}"]:
        assert guard in guards, guards
    # The printer columns showed the real trainer's figures while it ran.
    rows = transcript.rows(job)
    live = [r for r in rows if r[1] == "Running" and len(r) == 8 and r[2].isdigit() and int(r[2]) >= 1]
    assert live, f"no Running row with the trainer's step:\n{condensed(transcript, job)}"
    assert all(r[3].isdigit() and float(r[4]) >= 0 and r[5] == "1/1" for r in live), live
    assert next(r for r in rows if r[1] == "Succeeded")[2:4] == [str(steps), str(steps)]
    assert "No resources found" in transcript.lines[-1][1]
    # every process of the job is gone; so is every object the job owned ...
    assert not any(alive(pid) for pid in running.values())
    assert not e2e.pods(job) and not e2e.cluster.alive_processes()
    owned = [("configmaps", N.config_map(job)), ("secrets", N.redis_secret(job)),
             ("secrets", N.status_secret(job)), ("secrets", N.engine_secret(job)), ("services", N.redis(job)),
             ("services", N.trainer(job)), ("services", N.status_service(job)), ("statefulsets", N.redis(job)),
             ("statefulsets", N.trainer(job)), ("deployments", N.rollout(job)),
             ("networkpolicies", N.redis_network_policy(job)), ("persistentvolumeclaims", f"data-{N.redis(job)}-0"),
             ("deployments", N.reward(job)), ("services", N.reward(job)), ("networkpolicies", N.reward(job))]
    assert [o for o in owned if e2e.emu.get(o[0], NS, o[1])] == []
    # ... but the weights volume (not owned by default) stays, with the final weights on it
    assert e2e.emu.get("persistentvolumeclaims", NS, N.shared_pvc(job)) is not None
    assert N.shared_pvc(job) in deleted and N.redis(job) not in deleted
    weights = e2e.shared(job) / "weights"
    assert (weights / f"v{steps}" / "model.safetensors").is_file(), sorted(p.name for p in weights.iterdir())
    assert metrics_steps(e2e, job) == list(range(1, steps + 1))
    # each sample was the plug-in's two-turn episode with its calculator call, the call's result masked
    lines = [json.loads(line) for line in (e2e.shared(job) / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["turns_mean"] == 2.0 and m["tool_calls"] == 4 and m["tool_errors"] == 0 and m["masked_tokens"] > 0
               for m in lines if "event" not in m), lines


# (2. a SIGKILLed trainer resumes: tests/test_cluster_e2e_real.py, on the real control plane)


# ----------------------------------------------------------------------------------- 3. a trainer after the end


async def test_trainer_started_after_succeeded_serves_the_outcome_and_trains_nothing(e2e: E2E) -> None:
    job, steps = "e2e-after", 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps))
    await e2e.wait_phase(job, "Succeeded")
    await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero")
    shared = e2e.shared(job)

    def files() -> dict[str, Any]:
        return {"weights": sorted(p.name for p in (shared / "weights").iterdir()),
                "checkpoints": sorted(p.name for p in (shared / "checkpoints").iterdir()),
                "metrics": (shared / "runs" / "metrics.jsonl").read_text()}

    before, redis_before = files(), await redis_state(e2e, job)
    assert f"v{steps}" in before["weights"] and redis_before["outcome"].phase == "Succeeded"

    # One more trainer pod, exactly as the StatefulSet would run it (same name: same Redis consumer).
    sts = e2e.emu.get("statefulsets", NS, N.trainer(job))
    assert sts is not None
    pod_name = f"{N.trainer(job)}-0"
    template = sts["spec"]["template"]
    labels = {**template["metadata"]["labels"], "statefulset.kubernetes.io/pod-name": pod_name}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "namespace": NS, "labels": labels},
           "spec": {**template["spec"], "hostname": pod_name, "subdomain": N.trainer(job)}}
    path = e2e.tmp / "trainer-pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    assert "created" in await e2e.kubectl("apply", "--validate=false", "-f", str(path))
    await e2e.wait(lambda: "serving it without loading the model" in e2e.cluster.log(NS, pod_name, "trainer"),
                   "the new trainer finds the recorded outcome", timeout=120)
    port = e2e.cluster.host_port(NS, pod_name, STATUS_PORT)

    # The trainer requires the job's bearer token (from the operator's Secret, through its env).
    token = secret_value(e2e.emu.get("secrets", NS, N.status_secret(job)), "token")
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
    await e2e.wait(lambda: not e2e.pods(job, "trainer"), "the extra trainer pod gone")


# (4. a crash-looping trainer past backoffLimit: tests/test_cluster_e2e_real.py, on the real control plane)


# ----------------------------------------------------------------------------------- 5. drift


def uids(pods: list[dict[str, Any]]) -> set[str]:
    return {meta(p)["uid"] for p in pods}


def auth_hash(e2e: E2E, plural: str, name: str) -> str | None:
    obj = e2e.emu.get(plural, NS, name)
    return None if obj is None else obj["spec"]["template"]["metadata"]["annotations"].get(N.ANNOTATION_REDIS_AUTH_HASH)


async def test_drift_is_corrected_and_a_new_redis_secret_rolls_every_pod(e2e: E2E) -> None:
    job, steps, batch = "e2e-drift", 4, 2
    await e2e.start_operator(job)
    await e2e.apply(tiny_job(job, max_steps=steps, checkpoint_interval=2))
    await e2e.wait_phase(job, "Running", timeout=300)
    deploy = N.rollout(job)

    # A deleted rollout Deployment is re-created, and its pod comes back.
    old = e2e.emu.get("deployments", NS, deploy)
    assert old is not None
    old_pods = uids(e2e.pods(job, "rollout"))
    await e2e.kubectl("delete", "deployment", deploy, "-n", NS)
    await e2e.wait(lambda: (d := e2e.emu.get("deployments", NS, deploy))
                   and d["metadata"]["uid"] != old["metadata"]["uid"], "the Deployment re-created")
    await e2e.wait(lambda: (p := e2e.cluster.ready_pods(NS, {N.LABEL_JOB: job, N.LABEL_COMPONENT: "rollout"}))
                   and not uids(p) & old_pods, "a new rollout pod Ready")

    # A hand-edited replica count is put back.
    out = await e2e.kubectl("scale", "deployment", deploy, "-n", NS, "--replicas=3")
    assert "scaled" in out
    await e2e.wait(lambda: e2e.replicas("deployments", deploy) == 1 and len(e2e.pods(job, "rollout")) == 1,
                   "replicas corrected to 1, extra pods gone")

    # A deleted Redis Secret, mid-run (steps 1-2 checkpointed and acknowledged in Redis): a new one (new
    # password), and Redis, rollout and trainer roll onto it; Redis keeps its data (AOF on its volume), the
    # trainer resumes from its checkpoint.
    await e2e.wait(lambda: checkpointed(e2e, job), "the checkpoint of step 2", timeout=300)
    assert e2e.phase(job) == "Running"
    secret = e2e.emu.get("secrets", NS, N.redis_secret(job))
    assert secret is not None
    before = {c: uids(e2e.pods(job, c)) for c in ("redis", "rollout", "trainer")}
    hashes = {w: auth_hash(e2e, *w) for w in (("statefulsets", N.redis(job)), ("deployments", deploy),
                                               ("statefulsets", N.trainer(job)))}
    await e2e.kubectl("delete", "secret", N.redis_secret(job), "-n", NS)
    new_secret = await e2e.wait(lambda: (s := e2e.emu.get("secrets", NS, N.redis_secret(job)))
                                and s["metadata"]["uid"] != secret["metadata"]["uid"] and s, "a new Secret")
    assert new_secret["stringData"]["password"] != secret["stringData"]["password"]
    await e2e.wait(lambda: all(auth_hash(e2e, *w) not in (None, h) for w, h in hashes.items()),
                   "every workload's template carries the new Secret's hash")
    await e2e.wait(lambda: all(not uids(e2e.pods(job, c)) & before[c] for c in before)
                   , "every pod rolled", timeout=120)
    status = await e2e.wait_phase(job, "Succeeded")
    assert (status["reason"], status["trainer"]["step"]) == ("MaxStepsReached", steps), status
    assert "resumed from" in e2e.cluster.log(NS, f"{N.trainer(job)}-0", "trainer")
    trained = lineage(e2e, job)
    assert len(trained) == len(set(trained)) == steps * batch, trained
    state = await redis_state(e2e, job)  # through the new Secret: Redis and its clients agree
    assert state["trained"] == set(trained) and state["outcome"].phase == "Succeeded", state


# ----------------------------------------------------------------------------------- 6. LoRA


async def test_a_lora_job_hot_loads_adapters_survives_kills_and_succeeds(e2e: E2E) -> None:
    """spec.trainer.lora with the hf engine: every version on the weights volume is an adapter
    directory; the engine, killed, restarts on its base model and is caught up to the current adapter
    before its worker generates again; the trainer, killed, resumes from its adapter-only checkpoint;
    the job succeeds with each group trained once."""
    from asyncrl.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

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
