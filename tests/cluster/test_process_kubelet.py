"""The process kubelet as a node of the real control plane: the real scheduler binds pods to it, the real
controllers make them, and their containers run here as local processes (tests/support/kube_cluster/
real_cluster.py).

Tiny real processes only (`python -m http.server`, `python -c`, `sleep`); durations run 20x faster
(`time_scale=0.05`). Every test ends with no container process left alive and no error in the cluster.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.kube_cluster.network import Network
from tests.support.kube_cluster.node import LEASE_NAMESPACE
from tests.support.kube_cluster.objects import Obj, meta
from tests.support.kube_cluster.provisioner import STORAGE_CLASS
from tests.support.kube_cluster.real_cluster import POD_NETWORK, RealCluster
from tests.support.kube_cluster.rest import ApiError
from tests.support.kube_cluster.rewriting import AddressRewriter, PathRewriter, expand_vars
from tests.support.real_operator import audit_ref, audited

SCALE = 0.05
PY = "python"  # found on the pod's PATH: the test venv's bin comes first


def real_cluster(cp: ControlPlane, namespace: str, root: Path) -> RealCluster:
    return RealCluster(cp.kubeconfig, root, namespaces=[namespace], time_scale=SCALE,
                       node_kubeconfig=cp.node_kubeconfig)


@pytest.fixture
async def cluster(control_plane: ControlPlane, namespace: str, tmp_path: Path):
    async with real_cluster(control_plane, namespace, tmp_path / "cluster") as c:
        yield c
    assert not c.alive_processes(), f"container processes left behind: {c.alive_processes()}"
    assert not c.errors, "\n".join(c.errors)


def get(cp: ControlPlane, *args: str) -> Obj | None:
    """An object as the apiserver has it now (not a cache); None when it does not exist."""
    res = cp.kubectl("get", *args, "-o", "json")
    if res.returncode != 0:
        assert "NotFound" in res.stderr, res.stderr
        return None
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------------- manifests


def container(name: str, command: list[str], **extra: Any) -> Obj:
    return {"name": name, "image": "example/test:1", "command": command, **extra}


def http_server(port: int = 8080, directory: str = "/srv", **extra: Any) -> Obj:
    return container("web", [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", directory],
                     ports=[{"name": "http", "containerPort": port}], **extra)


def pod(name: str, namespace: str, containers: list[Obj], **spec: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": containers, **spec}}


def deployment(name: str, namespace: str, replicas: int, pod_spec: Obj) -> Obj:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}


def status_of(c: RealCluster, namespace: str, name: str) -> Obj:
    found = [p for p in c.pods(namespace) if meta(p)["name"] == name]
    return (found[0].get("status") or {}) if found else {}


def container_status(c: RealCluster, namespace: str, name: str) -> Obj:
    statuses = status_of(c, namespace, name).get("containerStatuses") or [{}]
    return statuses[0]


def condition(status: Obj, kind: str) -> str | None:
    return next((cond["status"] for cond in status.get("conditions") or [] if cond["type"] == kind), None)


# --------------------------------------------------------------------------------------- tests


def test_rewriting_rules() -> None:
    """Variables, mount paths and cluster addresses map as the module doc says."""
    assert expand_vars("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"

    paths = PathRewriter({"/etc/app": Path("/x/cm"), "/tmp": Path("/x/tmp"), "/dev/termination-log": Path("/x/t")},
                         ["/tmp/pytest-of-"])
    assert paths("--config=/etc/app/job.yaml") == "--config=/x/cm/job.yaml"
    assert paths("open('/tmp/a'); /tmpfoo /var/tmp /dev/termination-log") == "open('/x/tmp/a'); /tmpfoo /var/tmp /x/t"
    assert paths("/tmp/pytest-of-me/model") == "/tmp/pytest-of-me/model"  # host data handed to the pod

    net = Network()
    net.dns.update([
        {"metadata": {"name": "redis", "namespace": "rl"}, "spec": {"ports": [{"port": 6379}]}},
        {"metadata": {"name": "trainer", "namespace": "rl"}, "spec": {"clusterIP": "None", "ports": [{"port": 29500}]}},
    ])
    own = {30000: 41000}
    rw = AddressRewriter(net, "rl", own)
    redis = net.service_port("rl", "redis", 6379)
    assert rw("redis://:pw@redis.rl.svc:6379/0") == f"redis://:pw@127.0.0.1:{redis}/0"
    assert rw("redis:6379") == rw("redis.rl:6379") == rw("redis.rl.svc.cluster.local:6379") == f"127.0.0.1:{redis}"
    assert rw("redis:1234") == "redis:1234"  # not a port of the Service
    pod0 = net.pod_port("rl", "trainer-0", 29500)
    assert rw("--rdzv-endpoint=trainer-0.trainer.rl.svc:29500") == f"--rdzv-endpoint=127.0.0.1:{pod0}"
    assert rw("trainer-0.trainer:29500") == f"127.0.0.1:{pod0}"
    assert rw("http://127.0.0.1:30000/x") == "http://127.0.0.1:41000/x"
    assert rw("0.0.0.0:30000") == "0.0.0.0:41000"
    assert rw("30000") == "41000" and rw("--port=30000") == "--port=41000" and rw("300001") == "300001"
    assert rw("other.ns.svc") == "127.0.0.1" and rw("12:30") == "12:30" and rw("unknown:6379") == "unknown:6379"
    # A URL's short host is a Service the search path finds once it exists: resolved when the client
    # connects, so mapped now (its proxy refuses connections until the Service has Ready pods).
    later = net.service_port("rl", "reward", 8100)
    assert rw("http://reward:8100/score") == f"http://127.0.0.1:{later}/score"
    assert rw("http://reward.other:8100") == f"http://127.0.0.1:{net.service_port('other', 'reward', 8100)}"
    assert rw("reward:8100") == "reward:8100"  # not a URL: not taken for a name


def test_python_on_the_pod_path_is_the_test_venv() -> None:
    assert (Path(sys.executable).parent / PY).exists()




async def test_the_node_registers_ready_with_gpus_and_renews_its_lease(cluster: RealCluster,
                                                                        control_plane: ControlPlane):
    node = get(control_plane, "node", cluster.node_name)
    assert node is not None
    assert condition(node["status"], "Ready") == "True"
    assert not node["spec"].get("taints"), node["spec"]  # schedulable: the admission's not-ready taint is lifted
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    lease = get(control_plane, "lease", cluster.node_name, "-n", LEASE_NAMESPACE)
    assert lease is not None and lease["spec"]["holderIdentity"] == cluster.node_name
    assert lease["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]

    def renewed() -> bool:
        now = get(control_plane, "lease", cluster.node_name, "-n", LEASE_NAMESPACE) or {}
        return (now.get("spec") or {}).get("renewTime", "") > lease["spec"]["renewTime"]

    await cluster.wait(lambda: asyncio.to_thread(renewed), what="the node's Lease renewed")


async def test_a_deployment_pod_runs_becomes_ready_and_answers_through_its_service(
        cluster: RealCluster, control_plane: ControlPlane, namespace: str):
    ns = namespace
    await cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "site", "namespace": ns},
                          "data": {"hello.txt": "hello from web\n"}})
    web = http_server(readinessProbe={"httpGet": {"path": "/hello.txt", "port": "http"}, "periodSeconds": 1},
                      volumeMounts=[{"name": "site", "mountPath": "/srv"}])
    await cluster.create(deployment("web", ns, 1, {"containers": [web],
                                                   "volumes": [{"name": "site", "configMap": {"name": "site"}}]}))
    await cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
                          "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}})
    [ready] = await cluster.wait(lambda: cluster.ready_pods(ns, "app=web"), timeout=60, what="web Ready")

    # the real controllers made it (Deployment -> ReplicaSet -> pod) and the real scheduler bound it here
    assert meta(ready)["ownerReferences"][0]["kind"] == "ReplicaSet"
    assert ready["spec"]["nodeName"] == cluster.node_name
    status = ready["status"]
    for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
        assert condition(status, kind) == "True", (kind, status["conditions"])
    assert ipaddress.ip_address(status["podIP"]) in ipaddress.ip_network(POD_NETWORK)
    assert status["podIPs"] == [{"ip": status["podIP"]}] and status["hostIP"] == "127.0.0.1"
    assert status["startTime"] and status["qosClass"] == "BestEffort"  # the apiserver's, kept
    assert status["containerStatuses"][0]["ready"] is True and "running" in status["containerStatuses"][0]["state"]

    def available() -> bool:
        deploy = get(control_plane, "deployment", "web", "-n", ns) or {}
        return (deploy.get("status") or {}).get("availableReplicas") == 1

    await cluster.wait(lambda: asyncio.to_thread(available), timeout=60, what="the Deployment counts it available")

    def endpoint_ips() -> list[str]:
        slices = get(control_plane, "endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=web") or {}
        return [ip for s in slices.get("items") or [] for e in s.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready") for ip in e["addresses"]]

    assert await cluster.wait(lambda: asyncio.to_thread(endpoint_ips), timeout=60,
                              what="the EndpointSlice controller lists the pod") == [status["podIP"]]

    # the test reaches the Service as `kubectl port-forward svc/web` would ...
    async with httpx.AsyncClient() as http:
        answer = await http.get(f"http://127.0.0.1:{cluster.service_port(ns, 'web', 80)}/hello.txt")
    assert answer.text == "hello from web\n"
    # ... and another pod by its DNS name, the Service's ClusterIP and the web pod's IP
    svc_ip = (get(control_plane, "service", "web", "-n", ns) or {})["spec"]["clusterIP"]
    script = ("import urllib.request, sys\n"
              "for url in sys.argv[1:]:\n"
              "    print(urllib.request.urlopen(url, timeout=10).read().decode().strip())\n")
    urls = [f"http://web.{ns}.svc:80/hello.txt", f"http://{svc_ip}:80/hello.txt",
            f"http://{status['podIP']}:8080/hello.txt"]
    await cluster.create(pod("client", ns, [container("fetch", [PY, "-c", script, *urls])], restartPolicy="Never"))
    await cluster.wait(lambda: status_of(cluster, ns, "client").get("phase") in ("Succeeded", "Failed"),
                       timeout=60, what="the client pod done")
    assert status_of(cluster, ns, "client")["phase"] == "Succeeded", cluster.log(ns, "client", "fetch")
    assert cluster.log(ns, "client", "fetch").splitlines()[1:] == ["hello from web"] * 3


async def test_a_crashing_container_restarts_with_its_termination_message_and_backs_off(
        cluster: RealCluster, namespace: str):
    ns = namespace
    crash = [PY, "-c", "open('/dev/termination-log', 'w').write('boom: bad config'); raise SystemExit(3)"]
    await cluster.create(pod("crasher", ns, [container("main", crash)]))

    def crash_looping() -> bool:
        cs = container_status(cluster, ns, "crasher")
        return cs.get("restartCount", 0) >= 2 and (cs.get("state") or {}).get("waiting", {}).get(
            "reason") == "CrashLoopBackOff"

    await cluster.wait(crash_looping, timeout=60, what="crasher in CrashLoopBackOff after restarts")
    cs = container_status(cluster, ns, "crasher")
    last = cs["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"], last["message"]) == (3, "Error", "boom: bad config"), cs
    assert "back-off" in cs["state"]["waiting"]["message"]
    assert status_of(cluster, ns, "crasher")["phase"] == "Running"  # restartPolicy Always: never Failed
    assert condition(status_of(cluster, ns, "crasher"), "Ready") == "False"


async def test_a_failing_liveness_probe_restarts_the_container(cluster: RealCluster, namespace: str):
    ns = namespace
    # the startup probe holds the liveness probe off until the server answers: then /healthz is a 404
    web = http_server(directory="/tmp",
                      startupProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1,
                                    "failureThreshold": 1000},
                      livenessProbe={"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1,
                                     "failureThreshold": 2})
    await cluster.create(pod("unhealthy", ns, [web]))
    await cluster.wait(lambda: container_status(cluster, ns, "unhealthy").get("restartCount", 0) >= 1,
                       timeout=60, what="the liveness probe's restart")
    last = container_status(cluster, ns, "unhealthy")["lastState"]["terminated"]
    assert last["exitCode"] in (128 + signal.SIGTERM, 128 + signal.SIGKILL), last  # killed, not crashed
    assert any("liveness probe failed" in e for e in cluster.kubelet.events)
    assert '"GET /healthz HTTP/1.1" 404' in cluster.log(ns, "unhealthy", "web")


async def test_deleting_a_pod_sends_sigterm_and_the_kubelet_finishes_the_delete(
        cluster: RealCluster, control_plane: ControlPlane, namespace: str, tmp_path: Path):
    ns = namespace
    note = tmp_path / "signal.txt"  # host data a test hands to a pod: not rewritten (passthrough)
    script = ("import signal, sys, time\n"
              "def bye(sig, frame):\n"
              f"    open({str(note)!r}, 'w').write(signal.Signals(sig).name); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "while True: time.sleep(0.05)\n")
    await cluster.create(pod("graceful", ns, [container("main", [PY, "-c", script])],
                             terminationGracePeriodSeconds=60))
    await cluster.wait(lambda: status_of(cluster, ns, "graceful").get("phase") == "Running", timeout=60,
                       what="graceful running")
    pid = await cluster.wait(lambda: cluster.pid(ns, "graceful", "main"), what="its process")

    deleted = await asyncio.to_thread(control_plane.kubectl, "delete", "pod", "graceful", "-n", ns, "--wait=false")
    assert deleted.returncode == 0, deleted.stderr
    await cluster.wait(lambda: asyncio.to_thread(lambda: get(control_plane, "pod", "graceful", "-n", ns) is None),
                       timeout=60, what="the pod gone from the API")
    assert note.read_text() == "SIGTERM"
    assert cluster.pid(ns, "graceful", "main") is None and pid not in cluster.alive_processes()
    assert cluster.container(ns, "graceful", "main").state["terminated"]["exitCode"] == 0

    # The apiserver never removes a pod bound to a node by itself: the kubelet's final delete did (the audit
    # log has kubectl's graceful delete, then ours).
    def deletes() -> list[str]:
        agents = []
        for line in control_plane.audit_log.read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if (event["verb"], event["stage"], ref.get("resource"), ref.get("namespace"), ref.get("name")) == (
                    "delete", "ResponseComplete", "pods", ns, "graceful"):
                agents.append(event.get("userAgent", "").split("/")[0])
        return agents

    assert await cluster.wait(lambda: asyncio.to_thread(lambda: len(deletes()) == 2 and deletes()),
                              what="both deletes in the audit log") == ["kubectl", "process-kubelet"]


async def test_a_statefulset_gets_a_bound_claim_mounted_in_its_pod(cluster: RealCluster, control_plane: ControlPlane,
                                                                   namespace: str):
    ns = namespace
    labels = {"app": "db"}
    writer = container("db", ["sh", "-c", 'echo "$HOSTNAME" > /data/owner && exec sleep 600'],
                       volumeMounts=[{"name": "data", "mountPath": "/data"}],
                       readinessProbe={"exec": {"command": ["test", "-s", "/data/owner"]}, "periodSeconds": 1})
    await cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "db", "namespace": ns},
                          "spec": {"clusterIP": "None", "selector": labels, "ports": [{"port": 5432}]}})
    await cluster.create({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db", "namespace": ns},
                          "spec": {"replicas": 1, "serviceName": "db", "selector": {"matchLabels": labels},
                                   "template": {"metadata": {"labels": labels}, "spec": {"containers": [writer]}},
                                   "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                                       "accessModes": ["ReadWriteOnce"],
                                       "resources": {"requests": {"storage": "1Mi"}}}}]}})
    await cluster.wait(lambda: cluster.ready_pods(ns, "app=db"), timeout=90, what="db-0 Ready")

    claim = get(control_plane, "pvc", "data-db-0", "-n", ns) or {}
    assert claim["status"]["phase"] == "Bound", claim
    assert claim["spec"]["storageClassName"] == STORAGE_CLASS  # the default class, set by admission
    volume = get(control_plane, "pv", claim["spec"]["volumeName"]) or {}
    assert volume["spec"]["claimRef"]["uid"] == meta(claim)["uid"] and volume["status"]["phase"] == "Bound"
    owner = cluster.claim_path(ns, "data-db-0") / "owner"
    assert owner.read_text() == "db-0\n"
    assert Path(volume["spec"]["hostPath"]["path"]) == owner.parent


async def test_a_pod_asking_for_a_gpu_is_scheduled_and_one_asking_too_many_is_not(
        cluster: RealCluster, namespace: str):
    ns = namespace

    def gpu_pod(name: str, gpus: int) -> Obj:
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}}
        return pod(name, ns, [container("main", ["sleep", "600"], resources=resources)])

    await cluster.create(gpu_pod("one-gpu", 1))
    await cluster.create(gpu_pod("nine-gpus", 9))
    await cluster.wait(lambda: status_of(cluster, ns, "one-gpu").get("phase") == "Running", timeout=60,
                       what="the one-GPU pod running")
    [one] = [p for p in cluster.pods(ns) if meta(p)["name"] == "one-gpu"]
    assert one["spec"]["nodeName"] == cluster.node_name

    def unschedulable() -> Obj | None:
        conds = status_of(cluster, ns, "nine-gpus").get("conditions") or []
        return next((c for c in conds if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), None)

    refused = await cluster.wait(unschedulable, timeout=60, what="the scheduler refusing nine GPUs")
    assert "nvidia.com/gpu" in refused["message"], refused


async def test_stopping_the_cluster_kills_every_process_and_leaves_the_node(
        control_plane: ControlPlane, namespace: str, tmp_path: Path):
    ns = namespace
    async with real_cluster(control_plane, ns, tmp_path / "cluster") as c:
        sleeper = container("main", ["sh", "-c", "sleep 600 & sleep 600"])  # a child in the process group too
        await c.create(deployment("sleepers", ns, 2, {"containers": [sleeper]}))
        pods = await c.wait(lambda: len(c.ready_pods(ns, "app=sleepers")) == 2 and c.ready_pods(ns, "app=sleepers"),
                            timeout=60, what="two sleepers")
        mains = {c.pid(ns, meta(p)["name"], "main") for p in pods}
        assert None not in mains and mains <= set(c.alive_processes())
    assert not c.alive_processes()
    assert not c.errors, "\n".join(c.errors)
    assert get(control_plane, "node", c.node_name) is None
    bound = json.loads(control_plane.kubectl("get", "pods", "-n", ns, "-o", "json", "--field-selector",
                                             f"spec.nodeName={c.node_name}").stdout)["items"]
    assert bound == []


# ----------------------------------------------------------------------------------- probes and restarts


def http_probe(path: str, **extra: Any) -> Obj:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 1, **extra}


def ready_names(c: RealCluster, namespace: str) -> list[str]:
    return sorted(meta(p)["name"] for p in c.ready_pods(namespace))


async def test_readiness_needs_a_route_that_answers_and_an_exec_probe_sees_the_containers_paths(
        cluster: RealCluster, namespace: str):
    ns = namespace
    await cluster.create(pod("good", ns, [http_server(directory="/tmp", readinessProbe=http_probe("/"))]))
    await cluster.create(pod("bad", ns, [http_server(directory="/tmp", readinessProbe=http_probe("/missing"))]))
    # an exec probe sees the container's paths (rule 2): Ready once the file is in its emptyDir
    flag = container("main", ["sleep", "600"], readinessProbe={"exec": {"command": ["test", "-f", "/flags/ready"]},
                                                               "periodSeconds": 1},
                     volumeMounts=[{"name": "flags", "mountPath": "/flags"}])
    await cluster.create(pod("flag", ns, [flag], volumes=[{"name": "flags", "emptyDir": {}}]))
    await cluster.wait(lambda: ready_names(cluster, ns) == ["good"] and cluster.pid(ns, "flag", "main"),
                       timeout=60, what="good Ready")
    (cluster.volume_path(ns, "flag", "flags") / "ready").write_text("")
    await cluster.wait(lambda: ready_names(cluster, ns) == ["flag", "good"], timeout=60, what="flag Ready")
    await cluster.wait(lambda: status_of(cluster, ns, "bad").get("phase") == "Running", what="bad running")
    await asyncio.sleep(10 * SCALE)  # ten probe periods later: still not Ready, and never restarted
    assert ready_names(cluster, ns) == ["flag", "good"]
    assert (container_status(cluster, ns, "bad")["ready"], container_status(cluster, ns, "bad")["restartCount"]) \
        == (False, 0)
    ready = {c["type"]: c for c in status_of(cluster, ns, "bad")["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ContainersNotReady"), ready


async def test_a_startup_probe_holds_liveness_and_kills_when_it_fails(cluster: RealCluster, namespace: str):
    ns = namespace
    # generous thresholds, as a real slow starter sets them (scaled 20x, the defaults give 150 ms)
    slow = http_server(directory="/tmp", startupProbe=http_probe("/", failureThreshold=200),
                       livenessProbe=http_probe("/", failureThreshold=10), readinessProbe=http_probe("/"))
    never = http_server(directory="/tmp", startupProbe=http_probe("/missing", failureThreshold=2),
                        livenessProbe=http_probe("/"))
    await cluster.create(pod("slow", ns, [slow]))
    await cluster.create(pod("never", ns, [never]))
    await cluster.wait(lambda: ready_names(cluster, ns) == ["slow"], timeout=60, what="slow started and Ready")
    assert container_status(cluster, ns, "slow")["started"] is True
    await cluster.wait(lambda: container_status(cluster, ns, "never").get("restartCount", 0) >= 1, timeout=60,
                       what="never killed by its startup probe")
    assert container_status(cluster, ns, "never")["started"] is False
    assert any("startup probe failed" in e for e in cluster.kubelet.events)
    assert container_status(cluster, ns, "slow")["restartCount"] == 0


async def test_restart_policy_never_ends_in_succeeded_or_failed(cluster: RealCluster, namespace: str):
    ns = namespace
    await cluster.create(pod("ok", ns, [container("main", ["true"])], restartPolicy="Never"))
    await cluster.create(pod("ko", ns, [container("main", ["false"])], restartPolicy="Never"))
    await cluster.create(pod("retry", ns, [container("main", ["false"])], restartPolicy="OnFailure"))
    await cluster.wait(lambda: status_of(cluster, ns, "ok").get("phase") == "Succeeded"
                       and status_of(cluster, ns, "ko").get("phase") == "Failed", timeout=60, what="phases")
    assert container_status(cluster, ns, "ko")["state"]["terminated"]["exitCode"] == 1
    assert container_status(cluster, ns, "ko")["restartCount"] == 0
    await cluster.wait(lambda: container_status(cluster, ns, "retry").get("restartCount", 0) >= 1, timeout=60,
                       what="OnFailure restarts")


async def test_a_sigkilled_container_is_restarted_and_a_process_that_left_its_group_dies_with_it(
        cluster: RealCluster, namespace: str):
    """torchrun starts its workers in a new session: killing the container must take them along, as a
    PID namespace does (rule 6)."""
    ns = namespace
    script = ("import subprocess, time; c = subprocess.Popen(['sleep', '600'], start_new_session=True);"
              " print('child', c.pid, flush=True); time.sleep(600)")
    await cluster.create(pod("escape", ns, [container("main", [PY, "-c", script])]))

    def children() -> list[int]:
        return [int(line.split()[1]) for line in cluster.log(ns, "escape", "main").splitlines()
                if line.startswith("child ")]

    (first,) = await cluster.wait(children, timeout=60, what="first child")
    main = cluster.pid(ns, "escape", "main")
    assert main is not None and first in cluster.alive_processes() and os.getpgid(first) != main
    cluster.kill(ns, "escape", "main")
    # (the log shows the second child before the pod's status shows the restart: wait for both)
    await cluster.wait(lambda: len(children()) == 2 and container_status(cluster, ns, "escape").get("ready")
                       and container_status(cluster, ns, "escape").get("restartCount") == 1,
                       timeout=60, what="restarted with a second child")
    assert first not in cluster.alive_processes() and cluster.pid(ns, "escape", "main") not in (None, main)
    last = container_status(cluster, ns, "escape")
    assert (last["restartCount"], last["lastState"]["terminated"]["exitCode"]) == (1, 128 + signal.SIGKILL), last


async def test_a_pod_that_ignores_sigterm_is_killed_after_its_grace_period(
        cluster: RealCluster, control_plane: ControlPlane, namespace: str):
    ns = namespace
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True);"
                " time.sleep(600)")
    await cluster.create(pod("stubborn", ns, [container("main", [PY, "-c", stubborn])],
                             terminationGracePeriodSeconds=40))  # 2 s scaled
    # the line "up", not the start banner (which quotes the argv): SIGTERM is ignored from then on
    await cluster.wait(lambda: "up" in cluster.log(ns, "stubborn", "main").splitlines(), timeout=60,
                       what="stubborn up")
    pid = cluster.pid(ns, "stubborn", "main")
    deleted = await asyncio.to_thread(control_plane.kubectl, "delete", "pod", "stubborn", "-n", ns, "--wait=false")
    assert deleted.returncode == 0, deleted.stderr
    await cluster.wait(lambda: asyncio.to_thread(lambda: get(control_plane, "pod", "stubborn", "-n", ns) is None),
                       timeout=60, what="the pod gone after SIGKILL")
    assert pid is not None and pid not in cluster.alive_processes()
    assert cluster.container(ns, "stubborn", "main").state["terminated"]["exitCode"] == 128 + signal.SIGKILL


# ----------------------------------------------------------------------------------- network and storage


async def test_a_service_name_reaches_ready_pods_only(cluster: RealCluster, namespace: str):
    ns = namespace
    await cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "site", "namespace": ns},
                          "data": {"hello.txt": "hi from web"}})
    web = http_server(readinessProbe=http_probe("/"), volumeMounts=[{"name": "site", "mountPath": "/srv"}])
    await cluster.create(deployment("web", ns, 1, {"containers": [web],
                                                   "volumes": [{"name": "site", "configMap": {"name": "site"}}]}))
    # same labels, serves something else, never Ready: the Service must not send traffic to it
    impostor = pod("impostor", ns, [http_server(directory="/tmp", readinessProbe=http_probe("/missing"))])
    impostor["metadata"]["labels"] = {"app": "web"}
    await cluster.create(impostor)
    await cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
                          "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}})
    fetch = ("import os, time, urllib.request\n"
             "for url in [os.environ['LONG']] * 3 + [os.environ['SHORT']] * 3:\n"
             "    while True:\n"
             "        try:\n"
             "            print(urllib.request.urlopen(url, timeout=5).read().decode(), flush=True); break\n"
             "        except OSError:\n"
             "            time.sleep(0.05)\n"
             "time.sleep(600)\n")
    env = [{"name": "LONG", "value": f"http://web.{ns}.svc.cluster.local:80/hello.txt"},
           {"name": "HOST", "value": "web"}, {"name": "SHORT", "value": "http://$(HOST):80/hello.txt"}]
    await cluster.create(pod("client", ns, [container("main", [PY, "-c", fetch], env=env)]))
    await cluster.wait(lambda: cluster.log(ns, "client", "main").count("hi from web") == 6, timeout=60,
                       what="6 answers through the Service's names")
    assert "Directory listing" not in cluster.log(ns, "client", "main")


async def test_a_claim_made_after_its_pods_is_shared_by_them_with_secret_and_downward_env(
        cluster: RealCluster, namespace: str):
    ns = namespace
    await cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": ns},
                          "stringData": {"token": "t0k"}})
    await cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": ns},
                          "data": {"conf.yaml": "out: /data/out\nurl: http://db.other.svc:5432\n"}})
    script = "import os, time; open('/data/' + os.environ['POD'], 'w').write(os.environ['TOKEN']); time.sleep(600)"
    mounts = [{"name": "data", "mountPath": "/data"}, {"name": "cfg", "mountPath": "/etc/app"}]
    writer = container("main", [PY, "-c", script], volumeMounts=mounts,
                       env=[{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}])
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
               {"name": "cfg", "configMap": {"name": "cfg"}}]
    await cluster.create(deployment("w", ns, 2, {"containers": [writer], "volumes": volumes}))

    def waiting_for_the_claim() -> list[Obj]:
        pods = cluster.pods(ns, "app=w")
        return pods if len(pods) == 2 and all(
            any(c["type"] == "PodScheduled" and c["status"] == "False" and '"d" not found' in c.get("message", "")
                for c in (p.get("status") or {}).get("conditions") or []) for p in pods) else []

    # no claim yet: the scheduler leaves the pods unscheduled, naming it
    pending = await cluster.wait(waiting_for_the_claim, timeout=60, what="pods held for their claim")
    names = sorted(meta(p)["name"] for p in pending)
    await cluster.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                          "metadata": {"name": "d", "namespace": ns},
                          "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    shared = await cluster.wait(lambda: cluster.claim_path(ns, "d") if (cluster.api.get(
        "persistentvolumeclaims", ns, "d") or {}).get("status", {}).get("phase") == "Bound" else None,
        timeout=60, what="the claim Bound")
    await cluster.wait(lambda: shared.is_dir() and sorted(f.name for f in shared.iterdir()) == names
                       and all((shared / n).read_text() == "t0k" for n in names), timeout=60,
                       what="both pods wrote into the one claim")
    # the ConfigMap's file names container paths and a Service: both read right inside the pod
    conf = (cluster.volume_path(ns, names[0], "cfg") / "conf.yaml").read_text()
    assert conf == f"out: {shared}/out\nurl: http://127.0.0.1:{cluster.service_port('other', 'db', 5432)}\n"


async def test_the_kubelet_acts_as_its_node_and_the_node_authorizer_allows_only_what_its_pods_name(
        cluster: RealCluster, control_plane: ControlPlane, namespace: str):
    """The kubelet's requests are `system:node:<name>`'s: the Node authorizer lets it read the Secret and
    ConfigMap its pod names and refuses one no pod of the node names; NodeRestriction lets it write
    its pods' status, delete them and renew its own Lease. Nothing it did was refused."""
    ns, user = namespace, f"system:node:{cluster.node_name}"
    for name in ("named", "unnamed"):
        await cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
                              "stringData": {"token": name}})
    await cluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": ns},
                          "data": {"a.txt": "from the config map"}})
    reader = container("main", ["sh", "-c", 'cat /etc/cfg/a.txt; echo " $TOKEN"; exec sleep 600'],
                       env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "named", "key": "token"}}}],
                       volumeMounts=[{"name": "cfg", "mountPath": "/etc/cfg"}])
    await cluster.create(pod("reader", ns, [reader], volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}]))
    await cluster.wait(lambda: "from the config map named" in cluster.log(ns, "reader", "main"), timeout=60,
                       what="the pod read its ConfigMap and Secret")
    deleted = await asyncio.to_thread(control_plane.kubectl, "delete", "pod", "reader", "-n", ns, "--wait=false")
    assert deleted.returncode == 0, deleted.stderr
    await cluster.wait(lambda: asyncio.to_thread(lambda: get(control_plane, "pod", "reader", "-n", ns) is None),
                       timeout=60, what="the pod gone")
    assert cluster.node_client is not None
    with pytest.raises(ApiError) as refused:  # no pod of this node names it
        await cluster.node_client.request("GET", f"/api/v1/namespaces/{ns}/secrets/unnamed")
    assert refused.value.status == 403

    def by_node() -> set[tuple[str | None, str | None, str | None, str]]:
        return {(e["verb"], audit_ref(e, "resource"), audit_ref(e, "subresource"), str(e["responseStatus"]["code"]))
                for e in audited(control_plane, user) if audit_ref(e, "namespace") in (ns, LEASE_NAMESPACE, None)}

    await cluster.wait(lambda: cluster.node.renewals >= 1, timeout=30, what="a Lease renewal")
    made = by_node()
    for wanted in [("get", "secrets", None, "200"), ("get", "configmaps", None, "200"),
                   ("patch", "pods", "status", "200"), ("delete", "pods", None, "200"),
                   ("list", "pods", None, "200"), ("patch", "leases", None, "200"), ("create", "nodes", None, "201")]:
        assert wanted in made, (wanted, sorted(made, key=str))
    assert [m for m in made if m[3] == "403"] == [("get", "secrets", None, "403")], sorted(made, key=str)
