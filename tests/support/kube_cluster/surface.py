"""What a test reads and does to a running test cluster's pods (`RealCluster`'s surface): pods and their
readiness, container processes, logs, volumes, host ports, and a dump for a failing test."""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.support.kube_cluster.api import PodApi
from tests.support.kube_cluster.containers import ClusterOptions, ContainerRunner
from tests.support.kube_cluster.env import Volumes
from tests.support.kube_cluster.kubelet import Kubelet, PodRunner
from tests.support.kube_cluster.network import Network
from tests.support.kube_cluster.objects import Obj, is_terminating, labels_match, meta, pod_ready
from tests.support.polling import poll


class ClusterSurface:
    """Pods, their processes, logs, volumes and ports; waiting with the cluster's state on failure.

    A subclass sets `options`, `api`, `network`, `kubelet` and `errors` and keeps them current."""

    options: ClusterOptions
    api: PodApi
    network: Network
    kubelet: Kubelet
    errors: list[str]

    async def sync_once(self) -> None:
        raise NotImplementedError

    async def sync_loop(self) -> None:
        """`sync_once` every `options.tick` seconds until cancelled. An exception (a bug in the cluster, or
        a write the apiserver refused) is kept in `errors` for the test to see, not raised."""
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                error = traceback.format_exc()
                if not self.errors or self.errors[-1] != error:
                    self.errors.append(error)
            await asyncio.sleep(self.options.tick)

    # -- objects (the API a test would otherwise reach through kubectl; `create` is each cluster's own)

    async def patch(self, plural: str, namespace: str, name: str, body: Obj) -> Obj | None:
        return await self.api.patch(plural, namespace, name, body)

    async def scale(self, plural: str, namespace: str, name: str, replicas: int) -> Obj | None:
        return await self.api.patch(plural, namespace, name, {"spec": {"replicas": replicas}})

    async def delete(self, plural: str, namespace: str, name: str) -> None:
        await self.api.delete(plural, namespace, name)

    def pods(self, namespace: str | None = None, selector: Mapping[str, str] | str | None = None) -> list[Obj]:
        if isinstance(selector, str):
            selector = dict(term.split("=", 1) for term in selector.split(",") if term)
        return sorted((p for p in self.api.list("pods", namespace)
                       if labels_match(meta(p).get("labels") or {}, selector or {})),
                      key=lambda p: meta(p)["name"])

    def ready_pods(self, namespace: str | None = None, selector: Mapping[str, str] | str | None = None) -> list[Obj]:
        return [p for p in self.pods(namespace, selector) if pod_ready(p) and not is_terminating(p)]

    # -- the runtime side

    def runner(self, namespace: str, pod: str) -> PodRunner | None:
        """The newest runner of the pod named so (a StatefulSet pod may have had several)."""
        runners = self.kubelet.history.get((namespace, pod)) or []
        return runners[-1] if runners else None

    def container(self, namespace: str, pod: str, container: str) -> ContainerRunner:
        runner = self.runner(namespace, pod)
        found = [c for c in runner.containers if c.name == container] if runner else []
        if not found:
            raise KeyError(f"no container {container!r} in pod {namespace}/{pod}")
        return found[0]

    def pid(self, namespace: str, pod: str, container: str) -> int | None:
        """The running main process of the container, or None (not running, or no such pod admitted yet)."""
        try:
            c = self.container(namespace, pod, container)
        except KeyError:
            return None
        return c.process.pid if c.process is not None and c.process.returncode is None else None

    def kill(self, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL) -> int:
        """Chaos: signal the container's processes; returns the pid that was signalled."""
        pid = self.pid(namespace, pod, container)
        if pid is None:
            raise RuntimeError(f"{namespace}/{pod}/{container} is not running")
        self.container(namespace, pod, container).signal(sig)
        return pid

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.options.root / "logs" / f"{namespace}_{pod}_{container}.log"

    def log(self, namespace: str, pod: str, container: str) -> str:
        path = self.log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def volume_path(self, namespace: str, pod: str, volume: str) -> Path:
        runner = self.runner(namespace, pod)
        if runner is None or runner.volumes is None or volume not in runner.volumes:
            raise KeyError(f"volume {volume!r} of {namespace}/{pod} is not set up")
        return runner.volumes[volume]

    def claim_path(self, namespace: str, claim: str) -> Path:
        """The host directory a PersistentVolumeClaim's pods see."""
        obj = self.api.get("persistentvolumeclaims", namespace, claim)
        if obj is None:
            raise KeyError(f"no PersistentVolumeClaim {namespace}/{claim}")
        return self.api.bound_volume_path(obj) or Volumes(
            self.api, {"metadata": {"namespace": namespace}}, self.options.root,
            self.options.root / "claims").claim_dir(obj)

    def host_port(self, namespace: str, pod: str, container_port: int) -> int:
        """Where the pod's container port listens on this host."""
        return self.network.pod_port(namespace, pod, container_port)

    def service_port(self, namespace: str, service: str, port: int) -> int:
        """The local port of a Service port (what `kubectl port-forward svc/...` would give a test)."""
        return self.network.service_port(namespace, service, port)

    def alive_processes(self) -> list[int]:
        """Process groups of containers that still have a live process (a clean teardown leaves none)."""
        return self.kubelet.alive_process_groups()

    async def wait(self, check: Callable[[], Any], *, timeout: float = 20.0, what: str = "condition") -> Any:
        """Poll `check` (sync or async) until truthy; on timeout fail with the cluster's state (`dump`)."""
        return await poll(check, timeout=timeout, what=what, interval=0.02, describe=self.dump)

    def dump(self) -> str:
        """Pods, container states, recent events, errors and log tails: what a failing test should print."""
        lines = []
        for pod in self.pods():
            status = pod.get("status") or {}
            lines.append(f"pod {meta(pod)['namespace']}/{meta(pod)['name']} phase={status.get('phase')} "
                         f"terminating={is_terminating(pod)} cells={pod_cells(pod)}")
            for cs in status.get("containerStatuses") or []:
                lines.append(f"  {cs['name']}: state={cs.get('state')} last={cs.get('lastState')}")
                tail = self.log(meta(pod)["namespace"], meta(pod)["name"], cs["name"])[-1500:]
                lines += [f"    | {line}" for line in tail.splitlines()[-15:]]
        lines += [f"event {e}" for e in self.kubelet.events[-20:]]
        lines += [f"error {e}" for e in self.errors]
        return "\n".join(lines)


def pod_cells(pod: Obj) -> list[Any]:
    """READY, STATUS, RESTARTS as kubectl computes them for `kubectl get pods`."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    reason = status.get("reason") or status.get("phase") or "Pending"
    running = False
    for cs in reversed(statuses):
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state:
            term = state["terminated"]
            reason = term.get("reason") or f"ExitCode:{term.get('exitCode')}"
        elif "running" in state and cs.get("ready"):
            running = True
    if reason == "Completed" and running:
        reason = "Running"
    if is_terminating(pod):
        reason = "Terminating"
    ready = sum(bool(cs.get("ready")) for cs in statuses)
    return [f"{ready}/{total}", reason, sum(int(cs.get("restartCount") or 0) for cs in statuses)]
