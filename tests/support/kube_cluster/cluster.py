"""KubeCluster: the parts wired to a running KubeEmulator (package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.kube_cluster.api import Api, Clock
from tests.support.kube_cluster.containers import ClusterOptions
from tests.support.kube_cluster.controllers import ClaimBinder, DeploymentController, StatefulSetController
from tests.support.kube_cluster.kubelet import Kubelet
from tests.support.kube_cluster.network import Network
from tests.support.kube_cluster.objects import Obj
from tests.support.kube_cluster.rewriting import Hook
from tests.support.kube_cluster.surface import ClusterSurface
from tests.support.kube_cluster.tables import register_kubectl_tables
from tests.support.kube_emulator import KubeEmulator


class KubeCluster(ClusterSurface):
    """Controllers, kubelet and kube-proxy running against a KubeEmulator (package doc); an async context manager.

    Objects come from anywhere (kubectl, the operator, `create`); every `tick` seconds the cluster reads
    them and acts. Errors inside the cluster's own loop are kept in `errors` (a test should assert it is
    empty) rather than stopping it.
    """

    api: Api

    def __init__(self, emu: KubeEmulator, root: Path | str, *, time_scale: float = 1.0,
                 entrypoints: Mapping[str, Sequence[str]] | None = None, env: Mapping[str, str] | None = None,
                 hook: Hook | None = None, probe_timeout_floor: float = 0.5, passthrough: Sequence[str] = (),
                 bin_dirs: Sequence[str] = (), tick: float = 0.05, shutdown_grace: float = 2.0):
        self.options = ClusterOptions(Path(root), time_scale, dict(entrypoints or {}), dict(env or {}), hook,
                                      probe_timeout_floor, passthrough, bin_dirs, tick)
        self.emu = emu
        self.api = Api(emu)
        self.clock = Clock(time_scale, probe_timeout_floor)
        self.network = Network()
        self.kubelet = Kubelet(self.api, self.network, self.options, self.clock)
        self.deployments = DeploymentController(self.api)
        self.statefulsets = StatefulSetController(self.api)
        self.claims = ClaimBinder(self.api)
        self.shutdown_grace = shutdown_grace
        self.errors = self.kubelet.errors  # one list: loop, container supervisors and proxies append to it
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> KubeCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        self.options.root.mkdir(parents=True, exist_ok=True)
        register_kubectl_tables(self.emu)
        await self.kubelet.start()
        self._task = asyncio.create_task(self.sync_loop(), name="kube-cluster")

    async def stop(self) -> None:
        """Stop the loop, kill every pod's processes (SIGTERM, `shutdown_grace`, SIGKILL), close the proxies."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.kubelet.shutdown(self.shutdown_grace)
        await self.network.close()

    async def sync_once(self) -> None:
        """One pass of every controller, the kubelet and kube-proxy over the current objects."""
        claims = self.api.list("persistentvolumeclaims")
        await self.claims.sync(claims)
        pods = self.api.list("pods")
        await self.deployments.sync(self.api.list("deployments"), pods)
        await self.statefulsets.sync(self.api.list("statefulsets"), pods, claims)
        await self.kubelet.sync(self.api.list("pods"))
        for error in await self.network.sync(self.api.list("services"), self.api.list("pods")):
            if error not in self.errors:
                self.errors.append(error)

    # -- objects (the API a test would otherwise reach through kubectl)

    async def create(self, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {}).setdefault("namespace", "default")
        return await self.api.create(obj)

