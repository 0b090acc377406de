"""One container of a pod: start, restart with back-off, termination log and status."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.kube_cluster.env import ConfigError, StartError
from tests.support.kube_cluster.objects import BACKOFF_CAP, BACKOFF_INITIAL, CONTAINER_ENV, Obj, rfc3339
from tests.support.kube_cluster.probes import ProbeWorker, http_probe, tcp_probe
from tests.support.kube_cluster.processes import die_with_test_process, exit_code, kill_container, killpg
from tests.support.kube_cluster.rewriting import Hook, Launch

if TYPE_CHECKING:
    from tests.support.kube_cluster.kubelet import PodRunner


@dataclass
class ClusterOptions:
    """How pods become processes (package doc)."""

    root: Path
    time_scale: float = 1.0
    entrypoints: Mapping[str, Sequence[str]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    hook: Hook | None = None
    probe_timeout_floor: float = 0.5
    passthrough: Sequence[str] = ()
    bin_dirs: Sequence[str] = ()
    tick: float = 0.05

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.bin_dirs = tuple(self.bin_dirs) or (str(Path(sys.executable).parent),)
        self.passthrough = (str(self.root), os.path.join(tempfile.gettempdir(), "pytest-of-"),
                            *self.passthrough)


class ContainerRunner:
    """One container of one pod: start its process, run its probes, restart it with back-off, report status."""

    def __init__(self, pod: PodRunner, spec: Obj):
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.dir = pod.dir / "containers" / self.name
        self.termination_file = self.dir / "termination-log"
        self.log_path = pod.kubelet.options.root / "logs" / f"{pod.namespace}_{pod.name}_{self.name}.log"
        self.restart_count = 0
        self.attempts = 0
        self.state: Obj = {"waiting": {"reason": "ContainerCreating"}}
        self.terminations: list[Obj] = []
        self.ready = self.started = False
        self.process: asyncio.subprocess.Process | None = None
        self.pgid: int | None = None
        self.marker: str | None = None  # CONTAINER_ENV of the current instance's processes
        self.pids: list[int] = []
        self.done = False  # terminated and not to be restarted
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probes: list[tuple[ProbeWorker, asyncio.Task]] = []
        self._kills: set[asyncio.Task] = set()
        self._backoff: float | None = None
        self._backoff_at = 0.0

    # -- status

    def status(self) -> Obj:
        running = "running" in self.state
        # lastState: the termination before the current state (the one before that while terminated now)
        back = 2 if "terminated" in self.state else 1
        previous = self.terminations[-back] if len(self.terminations) >= back else None
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"local://{self.pids[-1]}" if self.pids else "",
                "ready": running and self.ready, "started": running and self.started,
                "restartCount": self.restart_count, "state": copy.deepcopy(self.state),
                "lastState": {"terminated": copy.deepcopy(previous)} if previous else {}}

    # -- lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"container {self.pod.name}/{self.name}")

    async def stop(self, grace: float) -> None:
        """Pod deletion: no more restarts; SIGTERM, `grace` seconds, SIGKILL."""
        self._stopping.set()
        await self._kill(grace)
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def signal(self, sig: int = signal.SIGKILL) -> None:
        """Chaos: signal the container's processes (the kubelet will see it exit and restart it)."""
        kill_container(self.pgid, self.marker, sig)

    async def _kill(self, grace: float) -> None:
        process, pgid, marker = self.process, self.pgid, self.marker
        if process is None or process.returncode is not None:
            return
        killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), grace)
        except asyncio.TimeoutError:
            kill_container(pgid, marker, signal.SIGKILL)

    async def _supervise(self) -> None:
        try:
            await self._supervise_loop()
        except Exception:  # a bug in the emulation: the cluster's `errors` shows it
            self.pod.kubelet.errors.append(f"{self.pod.namespace}/{self.pod.name}/{self.name}:\n"
                                           + traceback.format_exc())

    async def _supervise_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.pod.kubelet.api.fetch_for(self.pod.obj)  # what the pod names, read at each start
                launch = self.pod.launch(self, None)
            except ConfigError as exc:
                self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                await self._sleep(max(self.pod.kubelet.clock.seconds(1.0), 0.05))
                continue
            self.attempts += 1
            code = await self._run(launch)
            if self._stopping.is_set():
                return
            if not self.pod.should_restart(code):
                self.done = True
                return
            delay = self._backoff_delay(time.monotonic())
            if delay > 0:
                self.state = {"waiting": {"reason": "CrashLoopBackOff", "message":
                                          f"back-off {self._backoff:.0f}s restarting failed container={self.name} "
                                          f"pod={self.pod.name}_{self.pod.namespace}({self.pod.uid})"}}
                await self._sleep(delay)
                if self._stopping.is_set():
                    return
            self._backoff_next(time.monotonic())
            # the next instance is being made: counted, and no longer shown as the terminated one (a status
            # written meanwhile shows that termination as lastState, beside the new count)
            self.restart_count += 1
            self.state = {"waiting": {"reason": "ContainerCreating"}}

    def _backoff_delay(self, finished: float) -> float:
        """kubelet's CrashLoopBackOff: the first restart is immediate, then 10 s, 20 s, 40 s ... capped at 300 s;
        a container that ran 600 s since the last restart starts over (all scaled)."""
        clock = self.pod.kubelet.clock
        if self._backoff is None or finished - self._backoff_at > clock.seconds(2 * BACKOFF_CAP):
            return 0.0
        return clock.seconds(self._backoff)

    def _backoff_next(self, now: float) -> None:
        expired = self._backoff is None or now - self._backoff_at > self.pod.kubelet.clock.seconds(2 * BACKOFF_CAP)
        self._backoff = BACKOFF_INITIAL if expired else min(2 * self._backoff, BACKOFF_CAP)  # type: ignore[operator]
        self._backoff_at = now

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _run(self, launch: Launch) -> int:
        """One container instance: returns its exit code."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.termination_file.write_bytes(b"")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        with open(self.log_path, "ab") as log:
            log_offset = log.tell()
            log.write(f"=== {rfc3339(started)} start #{self.attempts} of {launch.namespace}/{launch.pod} "
                      f"(uid {self.pod.uid}) container {self.name}: {launch.argv}\n".encode())
            log.flush()
            self.marker = f"{self.pod.uid}/{self.name}/{self.attempts}"
            self.pod.kubelet.markers.add(self.marker)
            env = {**launch.env, CONTAINER_ENV: self.marker}  # after the hook: it cannot drop the marker
            try:
                exe = self.pod.executable(launch)
                self.process = await asyncio.create_subprocess_exec(
                    *launch.argv, executable=exe, env=env, cwd=launch.cwd, stdin=asyncio.subprocess.DEVNULL,
                    stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    preexec_fn=die_with_test_process)
            except (StartError, OSError) as exc:
                self._terminated(128, "StartError", f"failed to start container: {exc}", started, time.time())
                return 128
        self.pgid = self.process.pid
        self.pids.append(self.process.pid)
        self.pod.kubelet.process_groups.add(self.pgid)
        self.state = {"running": {"startedAt": rfc3339(started)}}
        self.ready = False
        self.started = "startupProbe" not in self.spec
        if self._stopping.is_set():
            kill_container(self.pgid, self.marker, signal.SIGKILL)
        self._start_probes(startup=not self.started)
        returncode = await self.process.wait()
        finished = time.time()
        for worker, task in self._probes:
            worker.stopped = True
            task.cancel()
        self._probes = []
        kill_container(self.pgid, self.marker, signal.SIGKILL)  # the rest of the container's processes die with it
        code = exit_code(returncode)
        self._terminated(code, "Completed" if code == 0 else "Error", self._message(code, log_offset),
                         started, finished)
        return code

    def _terminated(self, code: int, reason: str, message: str, started: float, finished: float) -> None:
        self.ready = self.started = False
        term: Obj = {"exitCode": code, "reason": reason, "startedAt": rfc3339(started),
                     "finishedAt": rfc3339(finished)}
        if self.pids:
            term["containerID"] = f"local://{self.pids[-1]}"
        if message:
            term["message"] = message
        self.terminations = [*self.terminations[-1:], term]
        self.state = {"terminated": term}

    def _message(self, code: int, log_offset: int) -> str:
        """terminationMessagePath's content; the log's tail for FallbackToLogsOnError after a failure."""
        try:
            text = self.termination_file.read_bytes()[:4096].decode(errors="replace")
        except OSError:
            text = ""
        if not text and code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            with open(self.log_path, "rb") as log:
                log.seek(log_offset)
                lines = log.read().decode(errors="replace").splitlines()[1:][-80:]
            text = "\n".join(lines)[-2048:]
        return text

    # -- probes

    def _start_probes(self, *, startup: bool) -> None:
        kinds = ["startup"] if startup else ["liveness", "readiness"]
        for kind in kinds:
            spec = self.spec.get(f"{kind}Probe")
            if spec:
                worker = ProbeWorker(kind, spec, self._check(spec), self.pod.kubelet.clock, self._on_probe)
                task = asyncio.create_task(worker.run(), name=f"{kind} {self.pod.name}/{self.name}")
                self._probes.append((worker, task))
        if not startup and not self.spec.get("readinessProbe"):
            self.ready = True

    def _check(self, spec: Obj) -> Callable[[float], Awaitable[bool]]:
        try:
            return self._action(spec)
        except ConfigError as exc:
            self.pod.kubelet.event(f"{self.pod.namespace}/{self.pod.name}/{self.name}: probe fails: {exc}")
            return self._unsupported

    def _action(self, spec: Obj) -> Callable[[float], Awaitable[bool]]:
        pod = self.pod
        if "httpGet" in spec:
            action = spec["httpGet"]
            port = pod.host_port(action.get("port"))
            return lambda timeout: http_probe(pod.kubelet.session, port, action, timeout)
        if "tcpSocket" in spec:
            action = spec["tcpSocket"]
            port = pod.host_port(action.get("port"))
            return lambda timeout: tcp_probe(port, action.get("host"), timeout)
        if "exec" in spec:
            return lambda timeout: self._exec(list(spec["exec"].get("command") or []), timeout)
        return self._unsupported

    @staticmethod
    async def _unsupported(timeout: float) -> bool:
        return False  # grpc probes are not emulated: they fail

    async def _exec(self, argv: list[str], timeout: float) -> bool:
        """An exec probe: the command with the container's env, rewritten like the container's own."""
        try:
            launch = self.pod.launch(self, argv)
            exe = self.pod.executable(launch)
            proc = await asyncio.create_subprocess_exec(
                *launch.argv, executable=exe, env=launch.env, cwd=launch.cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_test_process)
        except (ConfigError, StartError, OSError):
            return False
        try:
            return await asyncio.wait_for(proc.wait(), timeout) == 0
        except (asyncio.TimeoutError, asyncio.CancelledError):
            killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise

    def _on_probe(self, kind: str, ok: bool) -> bool:
        """A probe's threshold was reached; True ends that probe's worker."""
        if kind == "readiness":
            self.ready = ok
            return False
        if kind == "startup" and ok:  # liveness and readiness take over
            self.started = True
            self._start_probes(startup=False)
            return True
        if not ok:  # liveness or startup failure: kill; the supervisor restarts it
            spec = self.spec.get(f"{kind}Probe") or {}
            grace = spec.get("terminationGracePeriodSeconds", self.pod.grace_seconds)
            self.pod.kubelet.event(f"{self.pod.namespace}/{self.pod.name}/{self.name}: {kind} probe failed, killing")
            task = asyncio.create_task(self._kill(self.pod.kubelet.clock.seconds(grace)))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)
            return True
        return False
