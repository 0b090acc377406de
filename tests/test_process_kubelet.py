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
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.kube_cluster.node import LEASE_NAMESPACE
from tests.support.kube_cluster.objects import Obj, meta
from tests.support.kube_cluster.provisioner import STORAGE_CLASS
from tests.support.kube_cluster.real_cluster import POD_NETWORK, RealCluster

SCALE = 0.05
PY = "python"  # found on the pod's PATH: the test venv's bin comes first


def real_cluster(cp: ControlPlane, namespace: str, root: Path) -> RealCluster:
    return RealCluster(cp.kubeconfig, root, namespaces=[namespace], time_scale=SCALE)


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
