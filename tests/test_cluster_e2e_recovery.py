"""End-to-end scenarios on the REAL control plane: the real operator process and kubectl as in
tests/test_cluster_e2e.py, but the apiserver, scheduler and controllers (ReplicaSets, StatefulSet pods
and claims, PV binding, garbage collection of the job's children) are Kubernetes' own, and `RealCluster`
is the one node that runs every pod as local processes (tests/support/kube_cluster/real_cluster.py).

The chart is installed with helm and the operator runs with its ServiceAccount's token, so the
apiserver's own RBAC judges every request of every scenario (a 403 in the audit log fails the test).
The happy path also stays on the emulator (tests/test_cluster_e2e.py); the SIGKILL and backoff scenarios
live here only. It shares the job, hook and helpers of tests/support/cluster_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.models import cache_dir
from asyncrl.operator import names as N
from asyncrl.spec import API_VERSION, PLURAL
from tests.support.cluster_e2e import (
    E2E,
    NS,
    REDIS_PORT,
    SCALE,
    STATUS_PORT,
    PhaseLog,
    alive,
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
from tests.support.control_plane import ControlPlane, control_plane_fixture  # noqa: F401
from tests.support.kube_cluster import Launch, RealCluster
from tests.support.kube_cluster.rest import Reflector
from tests.support.operator_process import OperatorProcess
from tests.support.real_operator import (  # noqa: F401
    chart_release_fixture,
    crd_fixture,
    refused_by_rbac,
    service_account_kubeconfig,
)
from tests.support.redis_image import redis_bin_dir

pytestmark = pytest.mark.slow


class RealE2E(E2E):
    """E2E's kubectl, transcript, hook and waits, on the real control plane: reads come from watches."""

    def __init__(self, cp: ControlPlane, tmp: Path, operator_kubeconfig: Path):  # not E2E's: no emulator
        self.cp, self.tmp, self.kubeconfig = cp, tmp, cp.kubeconfig
        self.operator_kubeconfig = operator_kubeconfig
        """The chart ServiceAccount's: the operator makes every request with its token."""
        self.hooks = []
        self.operators = []
        self.applied = []
        self.cluster = RealCluster(
            cp.kubeconfig, tmp / "cluster", namespaces=[NS], time_scale=SCALE, hook=self._hook,
            probe_timeout_floor=3.0, bin_dirs=[str(Path(sys.executable).parent), str(redis_bin_dir(tmp))],
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ASYNCRL_TORCH_THREADS": "1",
                 "ASYNCRL_CACHE": str(cache_dir()), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        self.watches: dict[str, Reflector] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.cluster.start()
        client = self.cluster.client
        self.watches = {PLURAL: Reflector(client, PLURAL, path=f"/apis/{API_VERSION}/{PLURAL}"),
                        **{plural: Reflector(client, plural) for plural in ("statefulsets", "deployments")}}
        self._tasks = [asyncio.create_task(w.run()) for w in self.watches.values()]
        await asyncio.gather(*(w.synced.wait() for w in self.watches.values()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for op in self.operators:
            await op.stop()
        await self.cluster.stop()

    async def start_operator(self, job: str) -> OperatorProcess:
        status = f"http://127.0.0.1:{self.cluster.service_port(NS, N.status_service(job), STATUS_PORT)}"
        redis = f"redis://:{{password}}@127.0.0.1:{self.cluster.service_port(NS, N.redis(job), REDIS_PORT)}/0"
        op = OperatorProcess(self.operator_kubeconfig, self.tmp / "operator.log", interval=0.5,
                             status_url_template=status,
                             redis_url_template=redis, extra_args=("--namespace", NS))
        self.operators.append(await op.start())
        return op

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        if plural in self.watches:
            return self.watches[plural].get(NS, name)
        return self.cluster.api.get(plural, NS, name)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.get(PLURAL, name)

    def replicas(self, plural: str, name: str) -> int | None:
        obj = self.get(plural, name)
        return None if obj is None else obj["spec"].get("replicas")


@pytest.fixture
async def e2e(control_plane: ControlPlane, crd: None, chart_release, tmp_path: Path) -> AsyncIterator[RealE2E]:
    """The job's namespace, the chart installed with helm, and the operator acting as the chart's
    ServiceAccount: every request of every scenario goes through the apiserver's own RBAC (a 403 in the
    audit log fails the test)."""
    release_ns, installed = chart_release
    assert installed.returncode == 0, installed.stderr
    user, operator_kubeconfig = service_account_kubeconfig(control_plane, release_ns)
    # the emulator module's NS: its helpers name it; the session's control plane has it to itself
    control_plane.kubectl("create", "namespace", NS, check=True)
    env = RealE2E(control_plane, tmp_path, operator_kubeconfig)
    try:
        await env.start()
        yield env
    finally:
        await env.stop()
        # (waited for: the next test of the module makes the namespace again)
        control_plane.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=180s")
    assert not env.cluster.alive_processes(), f"container processes left behind: {env.cluster.alive_processes()}"
    assert not env.cluster.errors, "\n".join(env.cluster.errors)
    assert not refused_by_rbac(control_plane, user), f"the chart's RBAC refused: {refused_by_rbac(control_plane, user)}"


async def test_apply_runs_to_succeeded_releases_and_ttl_deletes_on_the_real_control_plane(e2e: RealE2E) -> None:
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
            status = await e2e.wait_phase(job, "Succeeded")
            shared = e2e.cluster.claim_path(NS, N.shared_pvc(job))
            await e2e.wait(lambda: released(e2e, job), "trainer and rollout scaled to zero, their pods gone")
            await e2e.wait(lambda: e2e.job(job) is None, "the job deleted by ttlSecondsAfterFinished", timeout=60)
            await e2e.wait(lambda: not e2e.get("statefulsets", N.redis(job)), "its children collected", timeout=60)
            await e2e.wait(lambda: not e2e.get("persistentvolumeclaims", f"data-{N.redis(job)}-0"),
                           "Redis's claim collected", timeout=60)
            await asyncio.sleep(1.0)  # the poller sees it gone
    deleted = await e2e.kubectl("get", "all,pvc", "-n", NS)
    print(f"\nphases: {phases.seen}\n{condensed(transcript, job)}\n--- Running ---\n{snapshot}\n"
          f"--- deleted (ttlSecondsAfterFinished) ---\n{deleted}")

    assert [p for p in phases.seen if p in ("Initializing", "Running", "Succeeded")] == \
        ["Initializing", "Running", "Succeeded"], phases.seen
    assert (status["reason"], status["trainer"]["step"], status["trainer"]["policyVersion"]) == \
        ("MaxStepsReached", steps, steps), status
    # pods made by the real controllers, bound to the process kubelet's node by the real scheduler
    assert e2e.cluster.node_name in snapshot and "Bound" in snapshot, snapshot
    assert "reward service" in e2e.cluster.log(NS, reward_pod, "reward"), reward_pod
    assert reward_refused == 401, reward_refused
    assert [line.split()[-1] for line in refused.splitlines()] == ["401", "401", "401", "200"], refused
    # the printer columns (the real CRD's) showed the real trainer's figures while it ran
    rows = transcript.rows(job)
    live = [r for r in rows if r[1] == "Running" and len(r) == 8 and r[2].isdigit() and int(r[2]) >= 1]
    assert live, f"no Running row with the trainer's step:\n{condensed(transcript, job)}"
    assert next(r for r in rows if r[1] == "Succeeded")[2:4] == [str(steps), str(steps)]
    # every process of the job is gone; the garbage collector took every object the job owned ...
    assert not any(alive(pid) for pid in running.values())
    assert not e2e.pods(job) and not e2e.cluster.alive_processes()
    owned = [("configmaps", N.config_map(job)), ("secrets", N.redis_secret(job)), ("services", N.redis(job)),
             ("statefulsets", N.trainer(job)), ("deployments", N.rollout(job)), ("deployments", N.reward(job))]
    await e2e.wait(lambda: [o for o in owned if e2e.get(*o)] == [], "the job's children collected", timeout=60)
    # ... but the weights volume (not owned by default) stays, with the final weights on it
    assert e2e.get("persistentvolumeclaims", N.shared_pvc(job)) is not None
    assert (shared / "weights" / f"v{steps}" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (shared / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "event" not in m] == list(range(1, steps + 1))
    assert all(m["turns_mean"] == 2.0 and m["tool_calls"] == 4 for m in metrics if "event" not in m), metrics


async def test_trainer_crashing_past_backoff_limit_fails_the_job(e2e: RealE2E) -> None:
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
    await e2e.apply(tiny_job(job, backoffLimit=1))
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


async def test_sigkilled_trainer_is_restarted_and_trains_each_group_once(e2e: RealE2E) -> None:
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
