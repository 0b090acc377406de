"""The process kubelet's Node: registration, status, the heartbeat Lease, and leaving the cluster."""

from __future__ import annotations

import asyncio
import datetime
import platform
from collections.abc import Mapping

from tests.support.kube_cluster.objects import LOCAL_IP, Obj, rfc3339
from tests.support.kube_cluster.real_api import RealApi
from tests.support.kube_cluster.rest import ApiError, path_of

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40  # kubelet's default nodeLeaseDurationSeconds; it renews every quarter of it
DEFAULT_CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi",
                    "nvidia.com/gpu": "8"}
"""Room for what the operator's pods request (a trainer asks for GPUs) on one machine: nothing is enforced."""


def micro_time(when: datetime.datetime | None = None) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    moment = when or datetime.datetime.now(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeAgent:
    """Registers the Node (Ready, schedulable, with capacity), renews its Lease, and on `leave` deletes it.

    The kubelet's part (the Node, its status, its Lease) is done as the node (`api.node`); lifting the
    admission's not-ready taint and deleting the Node and its pods on `leave` are the node lifecycle
    controller's and the pod garbage collector's, done with the cluster's view (NodeRestriction forbids a
    node to change its own taints)."""

    def __init__(self, api: RealApi, name: str, *, capacity: Mapping[str, str] | None = None,
                 pod_cidr: str = "10.244.0.0/16", renew_seconds: float = LEASE_SECONDS / 4,
                 kubelet_version: str = "v1.37.2"):
        self.api, self.name, self.pod_cidr = api, name, pod_cidr
        self.capacity = dict(capacity or DEFAULT_CAPACITY)
        self.renew_seconds, self.kubelet_version = renew_seconds, kubelet_version
        self.uid = ""
        self.renewals = 0

    def _labels(self) -> dict[str, str]:
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": arch}

    def status(self) -> Obj:
        now = rfc3339()
        healthy = [("MemoryPressure", "KubeletHasSufficientMemory"), ("DiskPressure", "KubeletHasNoDiskPressure"),
                   ("PIDPressure", "KubeletHasSufficientPID")]
        conditions = [{"type": kind, "status": "False", "reason": reason, "lastHeartbeatTime": now,
                       "lastTransitionTime": now} for kind, reason in healthy]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                           "message": "process kubelet is posting ready status", "lastHeartbeatTime": now,
                           "lastTransitionTime": now})
        info = {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": platform.release(),
                "osImage": "local processes", "containerRuntimeVersion": "process://0",
                "kubeletVersion": self.kubelet_version, "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": self._labels()["kubernetes.io/arch"]}
        return {"capacity": self.capacity, "allocatable": self.capacity, "conditions": conditions,
                "addresses": [{"type": "InternalIP", "address": LOCAL_IP}, {"type": "Hostname", "address": self.name}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}, "nodeInfo": info}

    async def register(self) -> None:
        node = await self.api.create({"apiVersion": "v1", "kind": "Node",
                                      "metadata": {"name": self.name, "labels": self._labels()},
                                      "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]}},
                                     client=self.api.node)
        self.uid = node["metadata"]["uid"]
        # TaintNodesByCondition admission taints a new node not-ready; the node lifecycle controller would
        # lift it once the node is Ready, but the test control plane does not run it.
        await self.api.patch("nodes", None, self.name, {"spec": {"taints": None}})
        await self.api.patch("nodes", None, self.name, {"status": self.status()}, "status", client=self.api.node)
        await self.api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": self.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                                   {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}]},
                               "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS,
                                        "renewTime": micro_time()}}, client=self.api.node)

    async def renew_forever(self, errors: list[str]) -> None:
        """The node heartbeat: renew the Lease every `renew_seconds` (errors are kept, not raised)."""
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                await self.api.patch("leases", LEASE_NAMESPACE, self.name, {"spec": {"renewTime": micro_time()}},
                                     client=self.api.node)
                self.renewals += 1
            except (ApiError, OSError) as exc:
                errors.append(f"lease {self.name}: {exc!r}")

    async def leave(self) -> None:
        """Delete the Node, then (as the pod garbage collector does for a deleted node's pods) every pod still
        bound to it, grace 0: nothing runs them any more. The Lease goes with the Node (owner reference)."""
        await self.api.delete("nodes", None, self.name)
        listed = await self.api.client.request("GET", path_of("pods"),
                                               params={"fieldSelector": f"spec.nodeName={self.name}"}) or {}
        for pod in listed.get("items") or []:
            await self.api.delete("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], grace=0,
                                  uid=pod["metadata"]["uid"])
