"""RealCluster: the test kubelet (local processes) as a node of a REAL control plane.

`RealCluster` attaches the process kubelet to a real kube-apiserver (tests/support/control_plane.py), so
everything above the node is Kubernetes' own code:

- real: the apiserver (validation of every status we write, defaulting, admission, graceful-deletion
  bookkeeping), the scheduler (binding, resources incl. `nvidia.com/gpu`, waiting for volume binding),
  and the controller-manager (Deployment -> ReplicaSet -> pods, StatefulSet pods and claims, PV binding,
  EndpointSlices, garbage collection, namespace deletion);
- ours (package doc, rules 1-8): containers as local processes, env and
  volumes, probes, restarts with CrashLoopBackOff, termination messages, the address/path/port rewriting,
  DNS names and Service proxies;
- ours, for the real API: a Node (`node.NodeAgent`: Ready, untainted, capacity with `nvidia.com/gpu`, a
  Lease in kube-node-lease renewed every 10 s, scaled), the kubelet's API side (`real_api.RealApi`: the
  pods bound to the node watched, what they name read per start, `pods/status` writes, the final
  delete, grace 0 with a uid precondition, once a deleted pod's processes are gone), and a hostPath
  provisioner (`provisioner.HostPathProvisioner`: a default StorageClass and one directory-backed
  PersistentVolume pre-bound to each pending claim).

With `node_kubeconfig` (a kubeconfig for `system:node:<name>` in `system:nodes`, given the node's name:
`ControlPlane.node_kubeconfig`), the kubelet and its Node act as that node, so the apiserver's Node
authorizer and NodeRestriction admission judge them as they judge a kubelet. The cluster's view
(`kubeconfig`, the test's) watches everything for the test and plays the parts that are not the
kubelet's: kube-proxy, the provisioner, the node lifecycle controller's taint lift and the pod
garbage collector.

Pod IPs come from `pod_network` (10.244.0.0/16, the usual pod CIDR; the EndpointSlice controller refuses
loopback addresses, the apiserver accepts them): nothing listens there; `<pod IP>:<port>` and
`<Service clusterIP>:<port>` are rewritten like DNS names (rule 3). Service names are resolved from the
Services and the pods this cluster sees (labels and readiness), not from the real
EndpointSlices, which the controller-manager writes all the same. `hostIP` is 127.0.0.1.

The kubelet watches all pods and runs those bound to its node (a real kubelet asks the apiserver for
those only; the test also reads the unscheduled ones), limited to `namespaces` when given: a session's
control plane is shared, and an earlier test's pods must not start here. `stop` kills every process,
deletes the Node and then the pods still bound to it (grace 0), as the pod garbage collector would.

Not emulated, beyond the package doc's list: node conditions other than Ready (no pressure, no NotReady
on stop: the Node is deleted), `status.observedGeneration`, kubelet's own API (logs, exec,
port-forward: use `log()`, `service_port()`), volume reclaim of anything but our PersistentVolumes, and
a second node.

Usage::

    async with RealCluster(control_plane.kubeconfig, tmp_path / "cluster", namespaces=[namespace],
                           time_scale=0.05) as cluster:
        await cluster.create(deployment)            # or kubectl / the operator
        await cluster.wait(lambda: cluster.ready_pods(namespace, "app=web"), what="web Ready")
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.kube_cluster.api import Clock
from tests.support.kube_cluster.containers import ClusterOptions
from tests.support.kube_cluster.kubelet import Kubelet
from tests.support.kube_cluster.network import Network
from tests.support.kube_cluster.node import LEASE_SECONDS, NodeAgent
from tests.support.kube_cluster.objects import Obj, meta
from tests.support.kube_cluster.provisioner import HostPathProvisioner
from tests.support.kube_cluster.real_api import RealApi, plural_of
from tests.support.kube_cluster.rest import RESOURCES, Credentials, RestClient
from tests.support.kube_cluster.rewriting import Hook
from tests.support.kube_cluster.surface import ClusterSurface

POD_NETWORK = "10.244.0.0/16"


class RealCluster(ClusterSurface):
    """The process kubelet and kube-proxy as one node of a real control plane (module doc); an async context
    manager. Errors inside its loop are kept in `errors` (a test should assert it is empty)."""

    api: RealApi

    def __init__(self, kubeconfig: Path | str, root: Path | str, *, node_name: str | None = None,
                 namespaces: Sequence[str] | None = None, time_scale: float = 1.0,
                 entrypoints: Mapping[str, Sequence[str]] | None = None, env: Mapping[str, str] | None = None,
                 hook: Hook | None = None, probe_timeout_floor: float = 0.5, passthrough: Sequence[str] = (),
                 bin_dirs: Sequence[str] = (), tick: float = 0.05, shutdown_grace: float = 2.0,
                 capacity: Mapping[str, str] | None = None, pod_network: str = POD_NETWORK,
                 node_kubeconfig: Callable[[str], Path] | None = None):
        self.options = ClusterOptions(Path(root), time_scale, dict(entrypoints or {}), dict(env or {}), hook,
                                      probe_timeout_floor, passthrough, bin_dirs, tick)
        self.node_name = node_name or f"process-kubelet-{os.urandom(3).hex()}"
        self.namespaces = set(namespaces) if namespaces is not None else None
        self.client = RestClient(Credentials.from_kubeconfig(Path(kubeconfig)))
        self.node_client = (RestClient(Credentials.from_kubeconfig(node_kubeconfig(self.node_name)))
                            if node_kubeconfig else None)
        self.api = RealApi(self.client, self.node_client, self.node_name)
        self.clock = Clock(time_scale, probe_timeout_floor)
        self.network = Network(pod_network)
        self.kubelet = Kubelet(self.api, self.network, self.options, self.clock)
        self.node = NodeAgent(self.api, self.node_name, capacity=capacity, pod_cidr=pod_network,
                              renew_seconds=self.clock.seconds(LEASE_SECONDS / 4))
        self.provisioner = HostPathProvisioner(self.api, self.options.root / "volumes")
        self.shutdown_grace = shutdown_grace
        self.errors = self.kubelet.errors
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> RealCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        self.options.root.mkdir(parents=True, exist_ok=True)
        await self.client.open()
        if self.node_client is not None:
            await self.node_client.open()
        await self.api.start()
        await self.provisioner.start()
        await self.kubelet.start()
        await self.node.register()
        self._tasks = [asyncio.create_task(self.sync_loop(), name="real-cluster"),
                       asyncio.create_task(self.node.renew_forever(self.errors), name="node lease")]

    async def stop(self) -> None:
        """Kill every pod's processes (SIGTERM, `shutdown_grace`, SIGKILL), leave the cluster, close up."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            await self.kubelet.shutdown(self.shutdown_grace)
            await self.network.close()
            if self.node.uid:  # registered (a start that failed earlier has nothing to undo there)
                await self.node.leave()
        finally:
            await self.api.stop()
            await self.client.close()
            if self.node_client is not None:
                await self.node_client.close()

    def own_pods(self) -> list[Obj]:
        """The pods bound to this node (in `namespaces`): the ones its kubelet runs."""
        return [p for p in self.api.node_pods.list() if (p.get("spec") or {}).get("nodeName") == self.node_name
                and (self.namespaces is None or meta(p).get("namespace") in self.namespaces)]

    async def sync_once(self) -> None:
        """One pass of the provisioner, the kubelet and kube-proxy over the watched objects."""
        await self.provisioner.sync()
        await self.kubelet.sync(self.own_pods())
        for error in await self.network.sync(self.api.list("services"), self.api.list("pods")):
            if error not in self.errors:
                self.errors.append(error)

    # -- objects (the API a test would otherwise reach through kubectl)

    async def create(self, obj: Obj) -> Obj:
        if RESOURCES[plural_of(obj["kind"])][1]:
            obj = {**obj, "metadata": {"namespace": "default", **(obj.get("metadata") or {})}}
        return await self.api.create(obj)

    def dump(self) -> str:
        watch = [f"watch {e}" for e in self.api.watch_errors()[-10:]]
        return "\n".join([f"node {self.node_name} lease renewals={self.node.renewals}", super().dump(), *watch])
