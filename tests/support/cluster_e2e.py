"""The end-to-end cluster scenarios' shared parts (tests/cluster/test_cluster_e2e.py and
tests/cluster/test_cluster_e2e_recovery.py): the tiny job, the `E2E` environment on the real control plane
(`RealCluster` as its one node, the chart installed with helm, the operator as the chart's
ServiceAccount, kubectl, the transcript, waits), and what the scenarios read from a job's volume, Redis
and pods.

What stands in for the images (tests/support/kube_cluster/ maps paths, Service names and declared ports
itself): the redis image's `redis-server`/`redis-cli` are the valkey binaries `asyncrl.local.redis_server` uses
(a bin dir on the pods' PATH); the trainer's status port, which it reads from the job file, is given as
`--status-port <host port>` (the hook); the node's model cache (`ASYNCRL_CACHE`) plays the pre-pulled
image, so the embedded GGUF is not converted again in every pod.

The operator runs outside the cluster, as it would on a laptop against a real one: it reaches the job's
status endpoint and Redis through the cluster's Service proxies (`--status-url-template`,
`--redis-url-template`, what `kubectl port-forward` would give it), so one operator process serves one job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from asyncrl.api.engine_servers import PROXY_READY_PATH
from asyncrl.api.spec import PLURAL
from asyncrl.infra.hf_models import cache_dir
from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from asyncrl.transport.streams import trained_ids
from tests.support.control_plane import ControlPlane, find_tool
from tests.support.jobs import JobBuilder
from tests.support.kube_cluster import Launch, RealCluster, meta
from tests.support.kube_cluster.rest import Reflector
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.real_operator import refused_by_rbac, service_account_kubeconfig
from tests.support.redis_image import redis_bin_dir
from tests.support.trainer_support import shared_tiny_model

NS = "rl"
SCALE = 0.05  # every Kubernetes duration (probe periods, back-off, grace periods) runs 20x faster
STATUS_PORT, REDIS_PORT = 8000, 6379
JOB_TIMEOUT = 420.0  # seconds for a job to finish on a busy 2-core machine (a wait, never an assertion)


def tiny_job(name: str, *, max_steps: int = 3, checkpoint_interval: int = 2, ttl: int | None = None,
             reward_service: bool = False, episode: bool = False, small_model: bool = False,
             **trainer: Any) -> dict[str, Any]:
    """A tiny job: 2 prompts x 2 samples of at most 8 tokens per step (`reward_service`: scored by a
    reward service the operator runs with the job, `asyncrl reward-server` in a pod of its own;
    `episode`: each sample a two-turn episode with a calculator call, from a plug-in module the
    rollout pods import from PYTHONPATH, as from a module baked into the worker image). `small_model`:
    the two-layer model of SmolLM2's architecture (trainer_support.shared_tiny_model, in the node's
    model cache) instead of the embedded one, where no step of the test waits inside the job's run
    (its steps take milliseconds: a kill "between step 3 and 4" would race the end)."""
    model = {"path": str(shared_tiny_model())} if small_model else None
    job = JobBuilder.small(name, group_size=2, eta=1, max_steps=max_steps, checkpoint_interval=checkpoint_interval,
                           micro_batch_tokens=4096, trainer=trainer, model=model).named(name, NS)
    job.merge(rollout={"maxConcurrentRequests": 8}).set(redis={"mode": "managed", "managed": {"storage": "1Gi"}},
                                                         storage={"size": "10Gi"})
    if ttl is not None:
        job.set(ttlSecondsAfterFinished=ttl)
    if reward_service:
        job.set(**{"reward.service": {"deployment": {}}})
    if episode:
        job.merge(rollout={"episode": "tests.support.episode_plugins:scored_two_turns", "tools": ["calculator"],
                           "episodeLimits": {"maxTurns": 2, "maxTokens": 512},
                           "podTemplate": {"env": [{"name": "PYTHONPATH", "value": str(REPO)}]}})
    return job.doc()


# ----------------------------------------------------------------------------------- the cluster


@dataclasses.dataclass
class Transcript:
    """`kubectl get asyncrljobs -n rl` polled while a test runs: (seconds since start, output)."""

    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)

    def rows(self, job: str) -> list[list[str]]:
        out = []
        for _, text in self.lines:
            out += [line.split() for line in text.splitlines() if line.split()[:1] == [job]]
        return out


class E2E:
    """One test's namespace on the session's control plane: `RealCluster` as its node, kubectl (as
    admin), the operator (as the chart's ServiceAccount), and waits; reads come from watches."""

    def __init__(self, cp: ControlPlane, tmp: Path, operator_kubeconfig: Path):
        self.cp, self.tmp, self.kubeconfig = cp, tmp, cp.kubeconfig
        self.operator_kubeconfig = operator_kubeconfig
        """The chart ServiceAccount's: the operator makes every request with its token."""
        self.hooks: list[Callable[[Launch], Launch]] = []
        self.operators: list[OperatorProcess] = []
        self.applied: list[str] = []
        """The jobs applied, by name (a failed wait prints their status)."""
        self.cluster = RealCluster(
            cp.kubeconfig, tmp / "cluster", namespaces=[NS], time_scale=SCALE, hook=self._hook,
            node_kubeconfig=cp.node_kubeconfig,
            probe_timeout_floor=3.0, bin_dirs=[str(Path(sys.executable).parent), str(redis_bin_dir(tmp))],
            # one torch thread per process (engine and trainer share 2 cores, as in `asyncrl run`); the
            # node's model cache (asyncrl.infra.hf_models; each pod's HOME=/tmp is an emptyDir of its own)
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ASYNCRL_TORCH_THREADS": "1",
                 "ASYNCRL_CACHE": str(cache_dir()), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        self.watches: dict[str, Reflector] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.cluster.start()
        client = self.cluster.client
        self.watches = {plural: Reflector(client, plural)
                        for plural in (PLURAL, "statefulsets", "deployments", "networkpolicies")}
        self._tasks = [asyncio.create_task(w.run()) for w in self.watches.values()]
        await asyncio.gather(*(w.synced.wait() for w in self.watches.values()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for op in self.operators:
            await op.stop()
        await self.cluster.stop()

    def _hook(self, launch: Launch) -> Launch:
        # The trainer listens on spec.trainer.statusPort, read from the job file (no rule maps a port
        # inside a config file): tell it the pod's host port for that container port.
        if launch.container == "trainer" and not launch.probe and "asyncrl.cli" in launch.argv:
            port = self.cluster.host_port(launch.namespace, launch.pod, STATUS_PORT)
            launch = dataclasses.replace(launch, argv=[*launch.argv, "--status-port", str(port)])
        for hook in self.hooks:
            launch = hook(launch)
        return launch

    # -- the operator, outside the cluster

    async def start_operator(self, job: str) -> OperatorProcess:
        status = f"http://127.0.0.1:{self.cluster.service_port(NS, N.status_service(job), STATUS_PORT)}"
        redis = f"redis://:{{password}}@127.0.0.1:{self.cluster.service_port(NS, N.redis(job), REDIS_PORT)}/0"
        op = OperatorProcess(self.operator_kubeconfig, self.tmp / "operator.log", interval=0.5,
                             status_url_template=status, redis_url_template=redis, extra_args=("--namespace", NS))
        self.operators.append(await op.start())
        return op

    # -- kubectl

    async def kubectl(self, *args: str, check: bool = True) -> str:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        proc = await asyncio.create_subprocess_exec(str(find_tool("kubectl")), *args, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
        return out.decode() + err.decode()

    async def apply(self, doc: dict[str, Any]) -> str:
        path = self.tmp / f"{doc['metadata']['name']}.yaml"
        self.applied.append(doc["metadata"]["name"])
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return await self.kubectl("apply", "-f", str(path))

    @contextlib.asynccontextmanager
    async def transcript(self, every: float = 0.5):
        """Poll `kubectl get asyncrljobs` in the background while the block runs."""
        record = Transcript()
        start = time.monotonic()

        async def poll() -> None:
            while True:
                out = await self.kubectl("get", "asyncrljobs", "-n", NS, check=False)
                record.lines.append((time.monotonic() - start, out))
                await asyncio.sleep(every)

        task = asyncio.create_task(poll())
        try:
            yield record
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- reading the cluster

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        """An object of the test's namespace as the watches have it (None: not there)."""
        if plural in self.watches:
            return self.watches[plural].get(NS, name)
        return self.cluster.api.get(plural, NS, name)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.get(PLURAL, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def pods(self, job: str, component: str | None = None) -> list[dict[str, Any]]:
        selector = {N.LABEL_JOB: job, **({N.LABEL_COMPONENT: component} if component else {})}
        return self.cluster.pods(NS, selector)

    def replicas(self, plural: str, name: str) -> int | None:
        obj = self.get(plural, name)
        return None if obj is None else obj["spec"].get("replicas")

    def shared(self, job: str) -> Path:
        """The job's weights volume (its PVC's directory)."""
        return self.cluster.claim_path(NS, N.shared_pvc(job))

    async def wait(self, check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        try:
            return await self.cluster.wait(check, timeout=timeout, what=what)
        except AssertionError as exc:
            # the operator's own lines (not its HTTP clients' debug lines) first, the cluster's state
            # (pods, container log tails) last: CI keeps the end of a long failure message
            lines = [line for op in self.operators[-1:] if op.log.exists()
                     for line in op.log.read_text().splitlines() if not line.split("]", 1)[-1].lstrip().startswith(
                         ("httpx", "httpcore", "urllib3"))]
            jobs = {name: self.status(name) for name in dict.fromkeys(self.applied)}
            raise AssertionError("--- operator log tail ---\n" + "\n".join(lines[-40:])
                                 + f"\n--- job status ---\n{json.dumps(jobs, indent=1)[-3000:]}\n{exc}") from None

    async def wait_phase(self, job: str, phase: str, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
        await self.wait(lambda: self.phase(job) in (phase, *({"Succeeded", "Failed"} - {phase})),
                        f"{job} {phase}", timeout)
        status = self.status(job)
        assert status["phase"] == phase, status
        return status


@pytest.fixture(name="e2e")
async def e2e_fixture(control_plane: ControlPlane, crd: None, chart_release: tuple[str, Any],
                      tmp_path: Path) -> AsyncIterator[E2E]:
    """The job's namespace, the chart installed with helm, and the operator acting as the chart's
    ServiceAccount: every request of every scenario goes through the apiserver's own RBAC (a 403 in the
    audit log fails the test). Use beside `control_plane_fixture`, `crd_fixture` and
    `chart_release_fixture` (imported into the test module)."""
    release_ns, installed = chart_release
    assert installed.returncode == 0, installed.stderr
    user, operator_kubeconfig = service_account_kubeconfig(control_plane, release_ns)
    control_plane.kubectl("create", "namespace", NS, check=True)  # the session's control plane: ours alone
    env = E2E(control_plane, tmp_path, operator_kubeconfig)
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


class PhaseLog:
    """Every phase the job's status went through, in order (polled in-process)."""

    def __init__(self, e2e: E2E, job: str):
        self.e2e, self.job = e2e, job
        self.seen: list[str] = []
        self._task: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            phase = self.e2e.phase(self.job)
            if phase and (not self.seen or self.seen[-1] != phase):
                self.seen.append(phase)
            await asyncio.sleep(0.02)

    def __enter__(self) -> PhaseLog:
        self._task = asyncio.create_task(self._poll())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()


def pids(e2e: E2E, job: str) -> dict[str, int]:
    """Main process of every running container of the job's pods: {pod/container: pid}."""
    out = {}
    for pod in e2e.pods(job):
        for c in pod["spec"]["containers"]:
            pid = e2e.cluster.pid(NS, meta(pod)["name"], c["name"])
            if pid is not None:
                out[f"{meta(pod)['name']}/{c['name']}"] = pid
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def volume_bound(e2e: E2E, job: str) -> bool:
    """Whether the job's weights volume is there to read: its claim exists and is Bound (on the real
    control plane the PV controller binds it a moment after the claim is made)."""
    claim = e2e.get("persistentvolumeclaims", N.shared_pvc(job))
    return claim is not None and (claim.get("status") or {}).get("phase") == "Bound"


def metrics_steps(e2e: E2E, job: str) -> list[int]:
    if not volume_bound(e2e, job):
        return []
    path = e2e.shared(job) / "runs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


async def redis_state(e2e: E2E, job: str) -> dict[str, Any]:
    """The job's Redis as a client reaches it through its Service: trained group ids, pending entries, outcome."""
    from asyncrl.api.outcome import read_outcome_redis
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect

    password = secret_value(e2e.get("secrets", N.redis_secret(job)), "password")
    assert password is not None
    port = e2e.cluster.service_port(NS, N.redis(job), REDIS_PORT)
    job_obj = e2e.job(job)
    assert job_obj is not None
    names = StreamNames.for_job(job, job_obj["metadata"]["uid"])
    client = await connect(f"redis://:{password}@127.0.0.1:{port}/0", timeout=10)
    try:
        return {"trained": await trained_ids(client, names),
                "pending": (await client.xpending(names.trajectories, names.consumer_group))["pending"],
                "versions": await client.xlen(names.versions),
                "outcome": await read_outcome_redis(client, names)}
    finally:
        await client.aclose()


def lineage(e2e: E2E, job: str) -> list[str]:
    """Group ids trained in the lineage of the newest checkpoint on the job's volume."""
    from asyncrl.trainer.state.checkpoint import latest_checkpoint, lineage_group_ids

    assert latest_checkpoint(e2e.shared(job) / "checkpoints") is not None, "no checkpoint on the weights volume"
    return lineage_group_ids(e2e.shared(job) / "checkpoints")


def checkpointed(e2e: E2E, job: str) -> bool:
    if not volume_bound(e2e, job):
        return False
    return any((e2e.shared(job) / "checkpoints").glob("step-*/state.json"))


def released(e2e: E2E, job: str) -> bool:
    """Trainer, rollout (and a reward service the operator runs) scaled to zero and their pods (so their
    processes) gone."""
    return (e2e.replicas("statefulsets", N.trainer(job)) == 0 and e2e.replicas("deployments", N.rollout(job)) == 0
            and e2e.replicas("deployments", N.reward(job)) in (0, None)
            and not e2e.pods(job, "trainer") and not e2e.pods(job, "rollout") and not e2e.pods(job, "reward"))


async def unauthenticated_engine_calls(e2e: E2E, job: str) -> str:
    """What the rollout pod's engine port (the engine proxy) answers another pod of the cluster without
    the job's API key: a weight update, a pause and the engine's /health, then the proxy's readiness,
    which the kubelet's probes need open. One line per call: `METHOD path -> status`."""
    (pod,) = e2e.pods(job, "rollout")
    url = f"http://127.0.0.1:{e2e.cluster.host_port(NS, pod['metadata']['name'], 30000)}"
    calls = [("POST", "/update_weights_from_disk", {"model_path": "/elsewhere", "weight_version": "99"}),
             ("POST", "/pause_generation", {"mode": "abort"}), ("GET", "/health", None),
             ("GET", PROXY_READY_PATH, None)]
    lines = []
    async with httpx.AsyncClient(timeout=30) as client:
        for method, path, body in calls:
            resp = await client.request(method, url + path, json=body)
            lines.append(f"{method} {path} -> {resp.status_code}")
    return "\n".join(lines)


async def unauthenticated_reward_call(e2e: E2E, job: str) -> tuple[str, int]:
    """The reward pod's name, and what its /score answers another pod without the job's key."""
    (pod,) = e2e.pods(job, "reward")
    url = f"http://127.0.0.1:{e2e.cluster.host_port(NS, pod['metadata']['name'], 8100)}/score"
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(url, json={"items": [{"completion": "42", "answer": "42"}]})
    return pod["metadata"]["name"], resp.status_code


def condensed(transcript: Transcript, job: str) -> str:
    """The transcript where the job's row changed (its AGE aside): `[seconds] kubectl output`."""
    out, last = [], None
    for t, text in transcript.lines:
        rows = [line.rsplit(None, 1)[0] for line in text.splitlines() if line.split()[:1] == [job]]
        key = rows or text.strip()
        if key != last:
            out.append(f"[{t:5.1f}s]\n{text.rstrip()}")
            last = key
    return "\n".join(out)
