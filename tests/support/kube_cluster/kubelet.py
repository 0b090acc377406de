"""The kubelet: runs every pod as local processes and writes its status back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.kube_cluster.api import Clock, PodApi
from tests.support.kube_cluster.containers import ClusterOptions, ContainerRunner
from tests.support.kube_cluster.env import ConfigError, EnvResolver, MountError, StartError, Volumes
from tests.support.kube_cluster.network import Network, named_port, pod_ports
from tests.support.kube_cluster.objects import (
    DEFAULT_TERMINATION_PATH,
    LOCAL_IP,
    TERMINATION_ENV,
    Obj,
    conditions,
    is_terminating,
    meta,
    rfc3339,
)
from tests.support.kube_cluster.processes import group_alive, marked_processes
from tests.support.kube_cluster.rewriting import AddressRewriter, Launch, PathRewriter, expand_vars


class PodRunner:
    """One admitted pod: its directories, volumes, ports and containers; the pod status it reports."""

    def __init__(self, kubelet: Kubelet, pod: Obj):
        self.kubelet, self.obj = kubelet, pod
        self.namespace = meta(pod).get("namespace") or "default"
        self.name, self.uid = meta(pod)["name"], meta(pod)["uid"]
        self.dir = kubelet.options.root / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        spec = pod.get("spec") or {}
        self.grace_seconds = float(spec.get("terminationGracePeriodSeconds", 30))
        network = kubelet.network
        self.own_ports = {p: network.pod_port(self.namespace, self.name, p) for p in sorted(pod_ports(pod))}
        self.ip = network.pod_ip(self.namespace, self.name)
        self.containers = [ContainerRunner(self, c) for c in spec.get("containers") or []]
        self.volumes: dict[str, Path] | None = None
        self.mount_error: str | None = None
        self.unsupported = "initContainers are not emulated" if spec.get("initContainers") else None
        self.start_time: str | None = None
        self.deleting = False
        self.stopped = False
        self.released = False  # the API was told the pod's processes are gone (Api.release_pod)
        self.written: Obj | None = None
        self._conditions: list[Obj] = []
        self._task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._mount_and_start(), name=f"pod {self.namespace}/{self.name}")

    async def _mount_and_start(self) -> None:
        try:
            await self._mount_and_start_containers()
        except Exception:  # a bug in the emulation (or an unwritable hostPath): the cluster's `errors` shows it
            self.kubelet.errors.append(f"{self.namespace}/{self.name}: mounting\n" + traceback.format_exc())

    async def _mount_and_start_containers(self) -> None:
        if self.unsupported:
            return
        api = self.kubelet.api
        while self.volumes is None:
            try:
                await api.fetch_for(self.obj)
                volumes = Volumes(api.reads_for(self.obj), self.obj, self.dir, self.kubelet.options.root / "claims",
                                  self.ip)
                self.volumes = volumes.materialize()
                self.mount_error = None
            except MountError as exc:
                self.mount_error = str(exc)
                await asyncio.sleep(max(self.kubelet.clock.seconds(1.0), 0.05))
        self._rewrite_volume_files()
        self.start_time = rfc3339()
        for container in self.containers:
            container.start()

    def _rewrite_volume_files(self) -> None:
        """Text files of configMap/secret/downwardAPI volumes get rules 2 and 3 (a job file names container
        paths and Service addresses too); the union of all containers' mounts gives the path map."""
        assert self.volumes is not None
        mounts = {m["mountPath"]: self.volumes[m["name"]] / m.get("subPath", "")
                  for c in self.containers for m in c.spec.get("volumeMounts") or [] if m["name"] in self.volumes}
        paths = PathRewriter(mounts, self.kubelet.options.passthrough)
        addresses = AddressRewriter(self.kubelet.network, self.namespace, self.own_ports)
        for vol in (self.obj.get("spec") or {}).get("volumes") or []:
            if not {"configMap", "secret", "projected", "downwardAPI"} & set(vol):
                continue
            for path in sorted(self.volumes[vol["name"]].rglob("*")):
                try:
                    text = path.read_text() if path.is_file() else None
                except UnicodeDecodeError:
                    continue
                if text is not None and (new := addresses.hosts(paths(text))) != text:
                    path.write_text(new)

    def begin_stop(self, grace: float) -> None:
        if self._stop_task is None:
            self.deleting = True
            self._stop_task = asyncio.create_task(self._stop(grace), name=f"stop {self.namespace}/{self.name}")

    async def _stop(self, grace: float) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(c.stop(grace) for c in self.containers))
        self.stopped = True

    async def wait_stopped(self) -> None:
        if self._stop_task is not None:
            await self._stop_task

    def should_restart(self, code: int) -> bool:
        policy = (self.obj.get("spec") or {}).get("restartPolicy") or "Always"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    # -- launching

    def host_port(self, port: Any) -> int:
        number = named_port(self.obj, port)
        if number is None:
            raise ConfigError(f"port {port!r} is not a container port of {self.name}")
        return self.own_ports.get(number, number)

    def _mounts(self, container: ContainerRunner) -> dict[str, Path]:
        assert self.volumes is not None
        out = {}
        for mount in container.spec.get("volumeMounts") or []:
            if mount["name"] not in self.volumes:
                raise ConfigError(f"volumeMount {mount['name']!r} names no volume")
            out[mount["mountPath"]] = self.volumes[mount["name"]] / mount.get("subPath", "")
        out[container.spec.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH] = container.termination_file
        return out

    def launch(self, container: ContainerRunner, probe_argv: list[str] | None) -> Launch:
        """argv/env/cwd of the container (probe_argv None) or of one of its exec probes (package doc, rules 1-7)."""
        options = self.kubelet.options
        spec = container.spec
        env = EnvResolver(self.kubelet.api.reads_for(self.obj), self.obj, self.ip).resolve(spec)
        if probe_argv is not None:
            argv = probe_argv
        else:
            command = [expand_vars(str(a), env) for a in spec.get("command") or []]
            args = [expand_vars(str(a), env) for a in spec.get("args") or []]
            if not command:
                entry = options.entrypoints.get(spec.get("image", ""))
                if entry is None:
                    raise ConfigError(f"no command, and image {spec.get('image')!r} has no entry in the cluster's "
                                      "entrypoints")
                command = list(entry)
            argv = command + args
        mounts = self._mounts(container)
        paths = PathRewriter(mounts, options.passthrough)
        addresses = AddressRewriter(self.kubelet.network, self.namespace, self.own_ports)
        argv = [addresses(paths(a)) for a in argv]
        env = {k: addresses(paths(v)) for k, v in env.items()}
        home = self.dir / "home"
        tmp = mounts.get("/tmp") or self.dir / "tmp"
        for path in (home, tmp, container.dir / "cwd"):
            Path(path).mkdir(parents=True, exist_ok=True)
        host_path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        process_env = {"HOME": str(home), "HOSTNAME": self.name, "TMPDIR": str(tmp), "LANG": "C.UTF-8",
                       **options.env, **env, TERMINATION_ENV: str(container.termination_file)}
        process_env["PATH"] = os.pathsep.join([*options.bin_dirs, *([env["PATH"]] if "PATH" in env else []),
                                               host_path])
        cwd = paths(spec["workingDir"]) if spec.get("workingDir") else str(container.dir / "cwd")
        launch = Launch(self.namespace, self.name, container.name, argv, process_env, cwd, probe_argv is not None)
        return options.hook(launch) if options.hook else launch

    @staticmethod
    def executable(launch: Launch) -> str:
        if not launch.argv:
            raise StartError("empty command")
        exe = launch.argv[0]
        found = exe if "/" in exe else shutil.which(exe, path=launch.env.get("PATH"))
        if not found or not os.access(found, os.X_OK):
            raise StartError(f'exec: "{exe}": executable file not found in $PATH')
        return found

    # -- status

    def phase(self) -> str:
        if self.volumes is None or any(c.attempts == 0 and not c.done for c in self.containers):
            return "Pending"
        if self.containers and all(c.done for c in self.containers):
            codes = [c.terminations[-1]["exitCode"] if c.terminations else 0 for c in self.containers]
            return "Succeeded" if all(code == 0 for code in codes) else "Failed"
        return "Running"

    def status(self) -> Obj:
        statuses = [c.status() for c in self.containers]
        if self.volumes is None:
            reason = self.unsupported or self.mount_error
            for st in statuses:
                st["state"] = {"waiting": {"reason": "ContainerCreating", **({"message": reason} if reason else {})}}
        phase = self.phase()
        unready = [s["name"] for s in statuses if not s["ready"]]
        ready = not unready and phase == "Running"
        reason = "PodCompleted" if phase in ("Succeeded", "Failed") else ("" if ready else "ContainersNotReady")
        message = "" if ready or reason == "PodCompleted" else f"containers with unready status: [{' '.join(unready)}]"
        self._conditions = conditions(self._conditions, [
            ("PodScheduled", True, "", ""), ("Initialized", not self.unsupported, "", self.unsupported or ""),
            ("ContainersReady", ready, reason, message), ("Ready", ready, reason, message)])
        out: Obj = {"phase": phase, "conditions": self._conditions, "hostIP": LOCAL_IP,
                    "hostIPs": [{"ip": LOCAL_IP}], "qosClass": "BestEffort", "containerStatuses": statuses}
        if self.volumes is not None:
            out.update(podIP=self.ip, podIPs=[{"ip": self.ip}])
        if self.start_time:
            out["startTime"] = self.start_time
        return out


class Kubelet:
    """Admits pods, runs them (PodRunner), writes their status, and finishes graceful deletion.

    The apiserver keeps a deleted pod bound to a node `Terminating` until its processes are gone; then
    the kubelet lets it go (`release_pod`: the final delete): the StatefulSet controller waits for that
    before recreating a pod under the same name.
    """

    def __init__(self, api: PodApi, network: Network, options: ClusterOptions, clock: Clock):
        self.api, self.network, self.options, self.clock = api, network, options, clock
        self.runners: dict[str, PodRunner] = {}
        self.history: dict[tuple[str, str], list[PodRunner]] = {}
        self.process_groups: set[int] = set()
        self.markers: set[str] = set()
        self.events: list[str] = []
        self.errors: list[str] = []
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]  # made in start()

    def event(self, text: str) -> None:
        self.events.append(f"{rfc3339()} {text}")

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def sync(self, pods: Sequence[Obj]) -> None:
        seen = set()
        for pod in pods:
            uid = meta(pod)["uid"]
            seen.add(uid)
            runner = self.runners.get(uid)
            if runner is None:
                if is_terminating(pod):
                    await self.api.release_pod(pod)  # deleted before it ran: nothing to stop
                    continue
                runner = self._admit(pod)
            runner.obj = pod
            if is_terminating(pod):
                grace = meta(pod).get("deletionGracePeriodSeconds", runner.grace_seconds)
                runner.begin_stop(self.clock.seconds(grace))
                if runner.stopped:
                    if not runner.released:
                        await self.api.release_pod(pod)
                        runner.released = True
                    continue
            status = runner.status()
            if status != runner.written:
                await self.api.replace_status("pods", pod, status)
                runner.written = status
        for uid in [u for u in self.runners if u not in seen]:
            runner = self.runners[uid]
            runner.begin_stop(self.clock.seconds(runner.grace_seconds))  # gone without us: kill it anyway
            if runner.stopped:
                del self.runners[uid]

    def _admit(self, pod: Obj) -> PodRunner:
        runner = PodRunner(self, pod)
        self.runners[runner.uid] = runner
        self.history.setdefault((runner.namespace, runner.name), []).append(runner)
        self.event(f"{runner.namespace}/{runner.name}: admitted (uid {runner.uid})")
        runner.start()
        return runner

    async def shutdown(self, grace: float) -> None:
        for runner in self.runners.values():
            runner.begin_stop(grace)
        await asyncio.gather(*(r.wait_stopped() for r in self.runners.values()), return_exceptions=True)
        for runner in self.runners.values():
            pod = self.api.get("pods", runner.namespace, runner.name)
            if pod is not None and meta(pod)["uid"] == runner.uid:
                await self.api.release_pod(pod)
        if self.session is not None:
            await self.session.close()

    def alive_process_groups(self) -> list[int]:
        """Process groups of containers with a live process, and live processes that left them (by marker)."""
        groups = {pgid for pgid in self.process_groups if group_alive(pgid)}
        return sorted(groups | set(marked_processes(self.markers)))
