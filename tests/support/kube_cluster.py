"""A test cluster that runs pods for real, on top of `KubeEmulator` (issue 18, part 6).

An API server alone lets a test pass where a cluster would fail: nothing runs the pods, so a trainer that
can never finish, or a readiness probe on a route the engine lacks, stays green. `KubeCluster` attaches to a
running `KubeEmulator` (in-process, same event loop) and adds what a cluster does after the API server
accepts an object:

- a Deployment controller and a StatefulSet controller (pods, PVCs from `volumeClaimTemplates`, `status`);
- a PVC binder (every claim is `Bound`, backed by a directory);
- a kubelet: every container is a real local process, probes are executed, containers restart with
  CrashLoopBackOff, pod status (`phase`, `conditions`, `containerStatuses`) is written back, pod deletion is
  graceful (SIGTERM, grace period, SIGKILL);
- kube-proxy and DNS: Service names resolve to a local TCP proxy that forwards to a Ready pod;
- `kubectl get pods|deploy|sts|svc|pvc|netpol|pdb|all`: the columns kubectl shows (registered in the
  emulator's `printers`) and the discovery short names (po, deploy, sts, svc, pvc, cm, netpol, pdb, ...)
  with the `all` category. NetworkPolicies and PodDisruptionBudgets are stored and listed, not enforced.

Usage::

    async with KubeEmulator() as emu, kmock.Server(emu), \\
            KubeCluster(emu, tmp_path / "cluster", time_scale=0.05,
                        entrypoints={"ghcr.io/asyncrl/trainer:0.1.0": ["asyncrl"]}) as cluster:
        await cluster.create(deployment)             # or kubectl / the operator, through the emulator
        await cluster.wait(lambda: cluster.ready_pods("default", "app=web"), what="web Ready")
        cluster.kill("default", pod_name, "web")     # chaos: SIGKILL the container's processes
        print(cluster.log("default", pod_name, "web"))

Mapping rules
-------------
All pods share this machine's filesystem, network and clock; these rules stand in for the namespaces a
container runtime would give them. They are applied, in this order, to every `command`/`args` item and
every `env` value of a container (and to exec-probe commands):

1. Variables: `$(VAR)` in `command`, `args` and `env` values expands as Kubernetes does (`$$` escapes).
2. Paths: an absolute `volumeMounts[].mountPath` (and the container's `terminationMessagePath`,
   default `/dev/termination-log`) that appears in a string at a path boundary is replaced by the host
   directory (file) standing in for it: `/etc/asyncrl/job.yaml` -> `<root>/pods/<ns>/<pod>-<uid>/volumes/
   config/job.yaml`. Longest mount path wins; a path under one of the `passthrough` prefixes (the cluster
   root and `/tmp/pytest-of-*` by default: host data a test hands to a pod) is left alone.
3. Addresses: `host:port` where `host` is a cluster name is replaced by `127.0.0.1:<host port>`:
   - a Service: `<svc>` (same namespace), `<svc>.<ns>`, `<svc>.<ns>.svc[.cluster.local]` and port = a
     Service port -> the Service's proxy port (a `.svc` name is rewritten even before the Service exists);
   - a pod of a headless Service (StatefulSet pod DNS): `<pod>.<svc>[.<ns>[.svc[.cluster.local]]]` ->
     that pod's host port for the container port;
   - `localhost`, `127.0.0.1`, `0.0.0.0` with one of the pod's own ports -> the same host with this pod's
     host port (a sibling container's port, or a listen address).
   A bare `<name>.<ns>.svc[.cluster.local]` with no port becomes `127.0.0.1`.
4. Ports: an argv item or env value that is exactly one of the pod's own ports (`"30000"`, or the value of
   `--flag=30000`) becomes the pod's host port for it. A pod's own ports are its containers' declared
   `containerPort`s plus numeric probe ports; each (namespace, pod name, port) gets one free host port for
   the cluster's life (a StatefulSet pod recreated under the same name keeps it).
   Rules 2 and 3 (not 1 or 4) also apply to the text files of configMap, secret and downwardAPI volumes
   (the union of the pod's mounts gives the path map): a job file that names `/shared/...` or
   `redis.rl.svc:6379` reads right inside the pod.
5. Termination log: each container instance gets a fresh file, found through rule 2 and through the env
   variable `ASYNCRL_TERMINATION_LOG`; its first 4096 bytes become `lastState.terminated.message`.
6. Process: argv = `command` + `args`, or `entrypoints[image]` + `args` when `command` is absent (the image
   is otherwise ignored); executables are found on PATH = `bin_dirs` (the test venv's bin first) +
   the container's own PATH + the host PATH. Environment = PATH, HOME (per pod), HOSTNAME (pod name),
   TMPDIR (the `/tmp` mount if any, else per pod), LANG, then the cluster's `env`, then the container's
   `envFrom`/`env`, then `ASYNCRL_TERMINATION_LOG`; nothing else leaks from the host. The cwd is
   `workingDir` (rule 2) or an empty directory per container. stdout+stderr go to
   `<root>/logs/<ns>_<pod>_<container>.log` (appended across restarts, one header line per start).
   The container instance's processes are its process group plus every process whose environment
   carries `KUBE_CLUSTER_CONTAINER=<pod uid>/<container>/<start>` (set after the hook): when the main
   process exits or is killed, all of them are SIGKILLed, as a PID namespace takes its processes along
   (torchrun starts its workers in a new session: the process group alone would miss them).
7. Hook: `hook(Launch) -> Launch` may rewrite argv/env/cwd of any container or exec probe where the rules
   above cannot be general (a port hidden inside a shell string, for instance).
8. Time: every duration a pod spec gives (probe delays and periods, back-off, grace periods) is multiplied
   by `time_scale` (0.1 = ten times faster); probe timeouts too, but never below `probe_timeout_floor`
   (a busy test machine must not fail a probe on a short timeout).

Kubelet behaviour: containers start together (no init containers); readiness is false until the probe's
`successThreshold`; a startup probe holds liveness/readiness off and `started` false; liveness or startup
failure (`failureThreshold` in a row) kills the container (SIGTERM, grace, SIGKILL) and restarts it;
`restartPolicy` Always/OnFailure/Never; restarts back off like kubelet (first at once, then 10 s, 20 s, 40 s
... capped at 300 s, reset after 600 s without a crash; `state.waiting.reason: CrashLoopBackOff` while
waiting); exit codes of signalled processes are 128+signal; `podIP`/`hostIP` are 127.0.0.1. When a
container's main process exits, the rest of its process group is killed (a container's pid namespace).
Pod deletion: the kubelet holds a finalizer on every pod it runs, so a deleted pod stays `Terminating`
(deletionTimestamp set) until its processes are gone, as on a real cluster.

Controllers: a Deployment owns its pods directly (no ReplicaSet objects); pods are named
`<deploy>-<template hash>-<5 chars>` and carry `pod-template-hash`; RollingUpdate honours maxSurge and
maxUnavailable, Recreate deletes first. A StatefulSet names pods `<sts>-<ordinal>` with hostname/subdomain,
creates `<claim>-<sts>-<ordinal>` PVCs from `volumeClaimTemplates`, starts OrderedReady pods one at a time
after the previous is Running and Ready (Parallel: all at once), scales down from the highest ordinal,
rolls a changed template from the highest ordinal one pod at a time (same names), honours `partition` and
`OnDelete`, and applies `persistentVolumeClaimRetentionPolicy` (whenDeleted: Delete -> the PVCs are owned
by the StatefulSet, so the emulator's garbage collector removes them with it; whenScaled: Delete -> the
claims of removed ordinals are deleted). Status fields are written as the API server serialises them
(zero-valued `omitempty` fields absent).

Not emulated: images (nothing is pulled or isolated; processes run as the test user with the host's
filesystem), init and ephemeral containers, lifecycle hooks (postStart/preStop), grpc probes, resource
limits (no OOMKilled, `resourceFieldRef` env is a config error), ConfigMap/Secret volume updates after
start, projected service-account tokens, service links env vars (`<SVC>_SERVICE_HOST`), Endpoints/
EndpointSlice objects, NetworkPolicy enforcement and PodDisruptionBudget status, node selection/taints,
ReplicaSet/Job/DaemonSet controllers, `minReadySeconds`, `kubectl logs/exec/port-forward` (use `log()`,
`service_port()`), UDP, ports not declared by a pod (they are not remapped, so two pods would collide), a
process that leaves its container's process group and also drops `KUBE_CLUSTER_CONTAINER` from its
environment survives container death; if the test process itself is killed (no teardown), container main
processes die with it (PR_SET_PDEATHSIG) but their children may not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import ctypes
import datetime
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import string
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from tests.support.kube_emulator import STANDARD_RESOURCES, KubeEmulator
from tests.support.polling import poll

Obj = dict[str, Any]

FINALIZER = "kube-cluster.asyncrl.test/kubelet"
LOCAL_IP = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "0.0.0.0"})
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
TERMINATION_ENV = "ASYNCRL_TERMINATION_LOG"
CONTAINER_ENV = "KUBE_CLUSTER_CONTAINER"  # marks a container instance's processes (module doc, rule 6)
BACKOFF_INITIAL, BACKOFF_CAP = 10.0, 300.0
PLURALS: dict[str, tuple[str, str, str]] = {plural: (group, version, kind)
                                            for (group, version, plural), (kind, _, _) in STANDARD_RESOURCES.items()}
KIND_PLURALS = {kind: plural for plural, (_, _, kind) in PLURALS.items()}


def rfc3339(when: float | None = None) -> str:
    moment = datetime.datetime.fromtimestamp(time.time() if when is None else when, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def is_terminating(obj: Obj) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def pod_ready(pod: Obj) -> bool:
    """Running and Ready, as controllers and the endpoints controller judge a pod."""
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in meta(obj).get("ownerReferences") or [])


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def template_hash(template: Obj) -> str:
    """A pod template's identity: pods whose hash differs from the owner's current one are out of date."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owner_reference(owner: Obj) -> Obj:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta(owner)["name"],
            "uid": meta(owner)["uid"], "controller": True, "blockOwnerDeletion": True}


def omit_zero(status: Obj, keys: Sequence[str]) -> Obj:
    """Drop zero values the API server never serialises (Go `omitempty`): readers must default them."""
    return {k: v for k, v in status.items() if not (k in keys and not v)}


def conditions(old: Sequence[Obj], new: Sequence[tuple[str, bool, str, str]]) -> list[Obj]:
    """Conditions (type, ok, reason, message) keeping `lastTransitionTime` while a status does not change."""
    before = {c.get("type"): c for c in old}
    out = []
    for kind, ok, reason, message in new:
        value = "True" if ok else "False"
        prev = before.get(kind) or {}
        cond: Obj = {"type": kind, "status": value,
                     "lastTransitionTime": prev["lastTransitionTime"] if prev.get("status") == value
                     and prev.get("lastTransitionTime") else rfc3339()}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        out.append(cond)
    return out


# ----------------------------------------------------------------------------------- time


class Clock:
    """Kubernetes durations scaled for tests (module doc, rule 8)."""

    def __init__(self, scale: float, timeout_floor: float):
        self.scale, self.timeout_floor = scale, timeout_floor

    def seconds(self, k8s_seconds: float) -> float:
        return max(float(k8s_seconds), 0.0) * self.scale

    def timeout(self, k8s_seconds: float) -> float:
        return max(self.seconds(k8s_seconds), self.timeout_floor)


# ----------------------------------------------------------------------------------- API access


class Api:
    """Reads and writes on the emulator, in-process, as controllers and the kubelet make them.

    In-process rather than over HTTP so the emulator's request log (the RBAC test reads it) holds only the
    operator's and kubectl's requests, and so a write is visible to the very next read. The emulator's
    private `_lock`, `_update` and `_delete` are used here and nowhere else in this module.
    """

    def __init__(self, emu: KubeEmulator):
        self.emu = emu

    @staticmethod
    def resource(plural: str) -> kmock.resource:
        group, version, _ = PLURALS[plural]
        return kmock.resource(group, version, plural)

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return self.emu.all(plural, namespace)

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        group = PLURALS[plural][0]
        return self.emu.get(plural, namespace, name, group=group)

    async def create(self, obj: Obj) -> Obj:
        plural = KIND_PLURALS[obj["kind"]]
        group, version, _ = PLURALS[plural]
        return await self.emu.put_object(group, version, plural, obj)

    def _live_key(self, plural: str, namespace: str | None, name: str) -> tuple | None:
        key = (self.resource(plural), namespace, name)
        if key not in self.emu.objects:
            return None
        return None if self.emu.objects[key].deleted else key

    async def patch(self, plural: str, namespace: str | None, name: str, body: Obj,
                    subresource: str | None = None) -> Obj | None:
        """A JSON merge patch (None deletes a key); None when the object is gone."""
        res = self.resource(plural)
        request = kmock.Request(resource=res, namespace=namespace, name=name, subresource=subresource,
                                    data=body, method=kmock.method.PATCH)
        async with self.emu._lock:
            key = self._live_key(plural, namespace, name)
            if key is None:
                return None
            return await self.emu._update(request, key, replace=False)

    async def replace_status(self, plural: str, obj: Obj, status: Obj) -> None:
        """Make `.status` exactly `status` (keys it lacks are removed), writing only when it differs."""
        old = obj.get("status") or {}
        if old == status:
            return
        body = {**{k: None for k in old if k not in status}, **status}
        await self.patch(plural, meta(obj).get("namespace"), meta(obj)["name"], {"status": body}, "status")

    async def delete(self, plural: str, namespace: str | None, name: str) -> None:
        """Delete as the API does: finalizers hold the object Terminating; owned objects are collected."""
        async with self.emu._lock:
            key = self._live_key(plural, namespace, name)
            if key is not None:
                await self.emu._delete(key)


# ----------------------------------------------------------------------------------- ports, DNS, kube-proxy


class PortRegistry:
    """One free host port per key, for the cluster's life.

    Keys are ("pod", ns, pod name, containerPort) and ("svc", ns, service, port): a client started before
    its server already knows the address, and a StatefulSet pod recreated under its name keeps its ports.
    """

    def __init__(self) -> None:
        self._ports: dict[tuple, int] = {}

    def get(self, key: tuple) -> int:
        if key not in self._ports:
            taken = set(self._ports.values())
            port = self._free_port()
            while port in taken:
                port = self._free_port()
            self._ports[key] = port
        return self._ports[key]

    @staticmethod
    def _free_port() -> int:
        with socket.socket() as sock:
            sock.bind((LOCAL_IP, 0))
            return sock.getsockname()[1]


@dataclass(frozen=True)
class ServiceName:
    namespace: str
    name: str


@dataclass(frozen=True)
class PodName:
    namespace: str
    name: str


class Dns:
    """Cluster DNS names -> what they name, in the order a pod's resolver (search path, ndots 5) tries them."""

    def __init__(self) -> None:
        self.services: dict[tuple[str, str], Obj] = {}

    def update(self, services: Sequence[Obj]) -> None:
        self.services = {(meta(s).get("namespace") or "default", meta(s)["name"]): s for s in services}

    def _headless(self, namespace: str, name: str) -> bool:
        svc = self.services.get((namespace, name))
        return svc is not None and (svc.get("spec") or {}).get("clusterIP") == "None"

    def lookup(self, host: str, namespace: str) -> ServiceName | PodName | None:
        name = host.lower().rstrip(".")
        qualified = False
        for suffix in (".svc.cluster.local", ".svc"):
            if name.endswith(suffix):
                name, qualified = name[: -len(suffix)], True
                break
        labels = name.split(".")
        if qualified:
            if len(labels) == 2:
                return ServiceName(labels[1], labels[0])
            return PodName(labels[2], labels[0]) if len(labels) == 3 else None
        if len(labels) == 1:
            return ServiceName(namespace, name) if (namespace, name) in self.services else None
        if len(labels) == 2:
            first, second = labels
            if self._headless(namespace, second):
                return PodName(namespace, first)
            return ServiceName(second, first) if (second, first) in self.services else None
        if len(labels) == 3 and self._headless(labels[2], labels[1]):
            return PodName(labels[2], labels[0])
        return None


class ServiceProxy:
    """kube-proxy for one Service port: a local listener that forwards each connection to a Ready endpoint.

    It listens only while the Service has endpoints, so a client sees "connection refused" when none is
    Ready, as with kube-proxy's reject rule.
    """

    def __init__(self, port: int, label: str):
        self.port, self.label = port, label
        self.endpoints: list[int] = []
        self.error: str | None = None
        self._server: asyncio.Server | None = None
        self._next = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def set_endpoints(self, endpoints: list[int]) -> None:
        self.endpoints = endpoints
        if endpoints and self._server is None:
            try:
                self._server = await asyncio.start_server(self._serve, LOCAL_IP, self.port, reuse_address=True)
                self.error = None
            except OSError as exc:
                self.error = f"{self.label}: cannot listen on {self.port}: {exc}"
        elif not endpoints and self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        await self.set_endpoints([])
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if not self.endpoints:
                return
            target = self.endpoints[self._next % len(self.endpoints)]
            self._next += 1
            try:
                up_reader, up_writer = await asyncio.open_connection(LOCAL_IP, target)
            except OSError:
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                self._writers.discard(up_writer)
                up_writer.close()
        finally:
            self._writers.discard(writer)
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            writer.close()


class Network:
    """Cluster addressing on one host: DNS names, per-pod host ports, and a proxy per Service port."""

    def __init__(self) -> None:
        self.dns = Dns()
        self.ports = PortRegistry()
        self.proxies: dict[tuple[str, str, int], ServiceProxy] = {}

    def pod_port(self, namespace: str, pod: str, container_port: int) -> int:
        return self.ports.get(("pod", namespace, pod, int(container_port)))

    def service_port(self, namespace: str, service: str, port: int) -> int:
        return self.ports.get(("svc", namespace, service, int(port)))

    def address(self, host: str, port: int, namespace: str, own: Mapping[int, int]) -> str | None:
        """The local `host:port` standing in for a cluster address, or None when it names nothing known."""
        if host.lower() in LOOPBACK_HOSTS:
            return f"{host}:{own[port]}" if port in own else None
        target = self.dns.lookup(host, namespace)
        if isinstance(target, PodName):
            return f"{LOCAL_IP}:{self.pod_port(target.namespace, target.name, port)}"
        if isinstance(target, ServiceName):
            svc = self.dns.services.get((target.namespace, target.name))
            if svc is not None and port not in {p.get("port") for p in (svc.get("spec") or {}).get("ports") or []}:
                return None
            return f"{LOCAL_IP}:{self.service_port(target.namespace, target.name, port)}"
        return None

    def endpoints(self, svc: Obj, port_spec: Obj, pods: Sequence[Obj]) -> list[int]:
        """Host ports of the pods a Service port selects: Ready ones (any with an IP if publishNotReady)."""
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector:
            return []
        namespace = meta(svc).get("namespace") or "default"
        target = port_spec.get("targetPort", port_spec.get("port"))
        out = []
        for pod in pods:
            if (meta(pod).get("namespace") != namespace or is_terminating(pod)
                    or not labels_match(meta(pod).get("labels") or {}, selector)):
                continue
            ok = pod_ready(pod) or (spec.get("publishNotReadyAddresses") and (pod.get("status") or {}).get("podIP"))
            number = named_port(pod, target)
            if ok and number is not None:
                out.append(self.pod_port(namespace, meta(pod)["name"], number))
        return sorted(out)

    async def sync(self, services: Sequence[Obj], pods: Sequence[Obj]) -> list[str]:
        """Follow Services and pod readiness; returns proxy errors (a port another process took)."""
        self.dns.update(services)
        wanted: dict[tuple[str, str, int], tuple[Obj, Obj]] = {}
        for svc in services:
            for port_spec in (svc.get("spec") or {}).get("ports") or []:
                if (port_spec.get("protocol") or "TCP") == "TCP" and port_spec.get("port"):
                    key = (meta(svc).get("namespace") or "default", meta(svc)["name"], int(port_spec["port"]))
                    wanted[key] = (svc, port_spec)
        for key in [k for k in self.proxies if k not in wanted]:
            await self.proxies.pop(key).close()
        errors = []
        for key, (svc, port_spec) in wanted.items():
            proxy = self.proxies.get(key)
            if proxy is None:
                proxy = self.proxies[key] = ServiceProxy(self.service_port(*key), "/".join(map(str, key)))
            await proxy.set_endpoints(self.endpoints(svc, port_spec, pods))
            if proxy.error:
                errors.append(proxy.error)
        return errors

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()
        self.proxies.clear()


def named_port(pod: Obj, port: Any) -> int | None:
    """A port number, or a container port's name resolved in `pod`."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for spec in container.get("ports") or []:
            if spec.get("name") == port:
                return int(spec["containerPort"])
    return None


def pod_ports(pod: Obj) -> set[int]:
    """The ports a pod owns (rule 4): declared container ports and numeric probe ports."""
    out: set[int] = set()
    for container in (pod.get("spec") or {}).get("containers") or []:
        out |= {int(p["containerPort"]) for p in container.get("ports") or [] if p.get("containerPort")}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            action = (container.get(probe) or {}).get("httpGet") or (container.get(probe) or {}).get("tcpSocket")
            if action and isinstance(action.get("port"), int):
                out.add(action["port"])
    return out


# ----------------------------------------------------------------------------------- rewriting


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_HOST_PORT = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*):(?P<port>\d{1,5})(?!\d)")
_SVC_HOST = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\.svc(?:\.cluster\.local)?)"
                       r"(?![\w.-]|:\d)")
_FLAG_VALUE = re.compile(r"^(?P<flag>--?[\w.-]+=)(?P<value>\d{1,5})$")
_PATH_END = re.compile(r"[\s'\"`:;,=()<>|&]")


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion (rule 1): unknown references stay as written, `$$` is a `$`."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(one, text)


class PathRewriter:
    """Container paths -> host paths (rule 2), in one pass so a rewritten path is never rewritten again."""

    def __init__(self, mapping: Mapping[str, Path], passthrough: Sequence[str]):
        self.mapping = {p.rstrip("/") or "/": str(host) for p, host in mapping.items()}
        self.passthrough = tuple(passthrough)
        paths = sorted((p for p in self.mapping if p != "/"), key=len, reverse=True)
        self._regex = (re.compile(r"(?<![\w./~-])(" + "|".join(map(re.escape, paths)) + r")(?![\w.-])")
                       if paths else None)

    def __call__(self, text: str) -> str:
        if self._regex is None:
            return text

        def one(m: re.Match[str]) -> str:
            end = _PATH_END.search(m.string, m.start())
            whole = m.string[m.start(): end.start() if end else len(m.string)]
            if whole.startswith(self.passthrough):
                return m.group(0)
            return self.mapping[m.group(1)]

        return self._regex.sub(one, text)


class AddressRewriter:
    """Cluster addresses and the pod's own ports -> local ones (rules 3 and 4)."""

    def __init__(self, network: Network, namespace: str, own: Mapping[int, int]):
        self.network, self.namespace, self.own = network, namespace, own

    def hosts(self, text: str) -> str:
        """Rule 3 only: addresses inside any text (also the files of configMap/secret volumes)."""
        def host_port(m: re.Match[str]) -> str:
            found = self.network.address(m.group("host"), int(m.group("port")), self.namespace, self.own)
            return found or m.group(0)

        def host_only(m: re.Match[str]) -> str:
            return LOCAL_IP if self.network.dns.lookup(m.group("host"), self.namespace) else m.group(0)

        return _SVC_HOST.sub(host_only, _HOST_PORT.sub(host_port, text))

    def __call__(self, text: str) -> str:
        """Rules 3 and 4: an argv item or env value."""
        text = self.hosts(text)
        if text.isdigit() and int(text) in self.own:
            return str(self.own[int(text)])
        flag = _FLAG_VALUE.match(text)
        if flag and int(flag.group("value")) in self.own:
            return flag.group("flag") + str(self.own[int(flag.group("value"))])
        return text


@dataclass(frozen=True)
class Launch:
    """What a container (or exec probe) process is started with; the cluster's `hook` may replace it."""

    namespace: str
    pod: str
    container: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    probe: bool = False


Hook = Callable[[Launch], Launch]


# ----------------------------------------------------------------------------------- env and volumes


class ConfigError(Exception):
    """The container cannot be configured yet (kubelet: CreateContainerConfigError); retried."""


class MountError(Exception):
    """A volume cannot be set up yet (kubelet: FailedMount, pod stays ContainerCreating); retried."""


class StartError(Exception):
    """The process cannot be started (kubelet: StartError, exit code 128); counts as a crash."""


def secret_data(secret: Obj) -> dict[str, bytes]:
    """A Secret's values; `stringData` too, which the emulator (unlike an API server) stores as sent."""
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return out


def config_map_data(cm: Obj) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return out


def field_value(pod: Obj, path: str) -> str:
    """A downward-API `fieldRef` of the pod."""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta(pod).get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {"metadata.name": meta(pod).get("name"), "metadata.namespace": meta(pod).get("namespace"),
              "metadata.uid": meta(pod).get("uid"), "spec.nodeName": "kube-cluster",
              "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
              "status.podIP": LOCAL_IP, "status.hostIP": LOCAL_IP, "status.podIPs": LOCAL_IP,
              "status.hostIPs": LOCAL_IP}
    if path not in simple:
        raise ConfigError(f"fieldRef {path!r} is not emulated")
    return str(simple[path] or "")


class EnvResolver:
    """A container's `envFrom` and `env`, resolved against ConfigMaps, Secrets and the pod, as kubelet does."""

    def __init__(self, api: Api, pod: Obj):
        self.api, self.pod = api, pod
        self.namespace = meta(pod).get("namespace") or "default"

    def _source(self, plural: str, name: str, optional: bool) -> dict[str, bytes] | None:
        obj = self.api.get(plural, self.namespace, name)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{plural[:-1]} "{name}" not found')
        return secret_data(obj) if plural == "secrets" else config_map_data(obj)

    def resolve(self, container: Obj) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            secret = "secretRef" in src
            ref, plural = (src["secretRef"], "secrets") if secret else (src.get("configMapRef"), "configmaps")
            data = self._source(plural, ref["name"], bool(ref.get("optional"))) if ref else None
            for key, raw in (data or {}).items():
                env[src.get("prefix", "") + key] = raw.decode(errors="replace")
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = expand_vars(str(var.get("value", "")), env)
                continue
            value = self._value_from(var["name"], var["valueFrom"])
            if value is not None:
                env[var["name"]] = value
        return env

    def _value_from(self, name: str, source: Obj) -> str | None:
        for key, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in source:
                ref = source[key]
                data = self._source(plural, ref["name"], bool(ref.get("optional")))
                if data is None:
                    return None
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    where = f'{plural[:-1]} {self.namespace}/{ref["name"]}'
                    raise ConfigError(f'couldn\'t find key {ref["key"]} in {where}')
                return data[ref["key"]].decode(errors="replace")
        if "fieldRef" in source:
            return field_value(self.pod, source["fieldRef"]["fieldPath"])
        raise ConfigError(f"env {name}: valueFrom {sorted(source)} is not emulated")


class Volumes:
    """A pod's volumes as host directories (rule 2): the kubelet's volume manager."""

    def __init__(self, api: Api, pod: Obj, pod_dir: Path, claims_root: Path):
        self.api, self.pod, self.pod_dir, self.claims_root = api, pod, pod_dir, claims_root
        self.namespace = meta(pod).get("namespace") or "default"

    def claim_dir(self, claim: Obj) -> Path:
        """One directory per PersistentVolumeClaim object (by uid): shared by every pod using the claim."""
        path = self.claims_root / self.namespace / f"{meta(claim)['name']}-{meta(claim)['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def materialize(self) -> dict[str, Path]:
        """Every volume's directory; MountError while a referenced object is missing."""
        out: dict[str, Path] = {}
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            name = vol["name"]
            if "persistentVolumeClaim" in vol:
                claim_name = vol["persistentVolumeClaim"]["claimName"]
                claim = self.api.get("persistentvolumeclaims", self.namespace, claim_name)
                if claim is None:
                    raise MountError(f'persistentvolumeclaim "{claim_name}" not found')
                out[name] = self.claim_dir(claim)
                continue
            if "hostPath" in vol:
                out[name] = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                    out[name].mkdir(parents=True, exist_ok=True)
                continue
            path = self.pod_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            sources = (vol["projected"].get("sources") or []) if "projected" in vol else [vol]
            for source in sources:
                self._fill(name, source, path)
            out[name] = path
        return out

    def _fill(self, name: str, source: Obj, path: Path) -> None:
        if "emptyDir" in source:
            return
        if "configMap" in source or "secret" in source:
            is_secret = "secret" in source
            ref = source["secret"] if is_secret else source["configMap"]
            obj_name = ref["secretName"] if is_secret else ref["name"]
            plural = "secrets" if is_secret else "configmaps"
            obj = self.api.get(plural, self.namespace, obj_name)
            if obj is None:
                if ref.get("optional"):
                    return
                raise MountError(f'volume {name}: {plural[:-1]} "{obj_name}" not found')
            data = secret_data(obj) if is_secret else config_map_data(obj)
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise MountError(f'volume {name}: key {item["key"]} not in {plural[:-1]} "{obj_name}"')
                self._write(path / item["path"], data[item["key"]])
            return
        if "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise MountError(f"volume {name}: downwardAPI {sorted(item)} is not emulated")
                fp = item["fieldRef"]["fieldPath"]
                if fp in ("metadata.labels", "metadata.annotations"):
                    pairs = meta(self.pod).get(fp.split(".")[1]) or {}
                    text = "\n".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))
                else:
                    text = field_value(self.pod, fp)
                self._write(path / item["path"], text.encode())
            return
        raise MountError(f"volume {name}: {sorted(k for k in source if k != 'name')} is not emulated")

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


# ----------------------------------------------------------------------------------- probes


async def http_probe(session: aiohttp.ClientSession, port: int, action: Obj, timeout: float) -> bool:
    scheme = (action.get("scheme") or "HTTP").lower()
    host = action.get("host") or LOCAL_IP
    path = action.get("path") or "/"
    headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
    try:
        async with session.get(f"{scheme}://{host}:{port}{path}", headers=headers, allow_redirects=False,
                               ssl=False, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return 200 <= resp.status < 400
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def tcp_probe(port: int, host: str | None, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host or LOCAL_IP, port), timeout)
    except (asyncio.TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class ProbeWorker:
    """One probe of one container instance on kubelet's schedule: wait `initialDelaySeconds`, then probe every
    `periodSeconds` with `timeoutSeconds`; report when `successThreshold` successes or `failureThreshold`
    failures in a row are reached (once per streak); `report` returns True to end the worker."""

    def __init__(self, kind: str, spec: Obj, check: Callable[[float], Awaitable[bool]], clock: Clock,
                 report: Callable[[str, bool], bool]):
        self.kind, self.check, self.clock, self.report = kind, check, clock, report
        self.initial_delay = float(spec.get("initialDelaySeconds", 0))
        self.period = float(spec.get("periodSeconds", 10))
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.last: bool | None = None
        self.stopped = False  # besides cancel(): Python 3.11's wait_for can swallow a cancellation

    async def run(self) -> None:
        await asyncio.sleep(self.clock.seconds(self.initial_delay))
        successes = failures = 0
        while not self.stopped:
            try:
                ok = await asyncio.wait_for(self.check(self.clock.timeout(self.timeout)),
                                            self.clock.timeout(self.timeout) + 1.0)
            except (asyncio.TimeoutError, RuntimeError, OSError):  # RuntimeError: the cluster is shutting down
                ok = False
            if self.stopped:
                return
            self.last = ok
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if successes == self.success_threshold and self.report(self.kind, True):
                return
            if failures == self.failure_threshold and self.report(self.kind, False):
                return
            await asyncio.sleep(self.clock.seconds(self.period))


# ----------------------------------------------------------------------------------- processes


def exit_code(returncode: int) -> int:
    """A container's exit code: 128 + signal for a signalled process, as container runtimes report it."""
    return returncode if returncode >= 0 else 128 - returncode


def killpg(pgid: int | None, sig: int) -> None:
    if pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def marked_processes(markers: Sequence[str] | set[str]) -> list[int]:
    """Live processes whose environment carries `CONTAINER_ENV=<marker>` for one of `markers` (read from
    /proc; a zombie's environment is empty): a container instance's processes, wherever they went."""
    needles = [f"\0{CONTAINER_ENV}={marker}\0".encode() for marker in markers]
    if not needles:
        return []
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            data = b"\0" + environ.read_bytes()
        except OSError:
            continue
        if any(needle in data for needle in needles):
            out.append(int(environ.parent.name))
    return out


def kill_container(pgid: int | None, marker: str | None, sig: int) -> None:
    """Signal every process of a container instance: its process group, and the processes that left it
    (a new session, as torchrun's workers) but carry its marker, as a PID namespace would take them along."""
    killpg(pgid, sig)
    for pid in marked_processes([marker] if marker else []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def die_with_test_process() -> None:
    """preexec_fn of every container process: SIGKILL it if the test process dies without stopping the
    cluster (a test runner killed by a timeout must not leave pods running; grandchildren are not covered)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group `pgid` (read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


@dataclass
class ClusterOptions:
    """How pods become processes (module doc)."""

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
            self.restart_count += 1

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
        self.containers = [ContainerRunner(self, c) for c in spec.get("containers") or []]
        self.volumes: dict[str, Path] | None = None
        self.mount_error: str | None = None
        self.unsupported = "initContainers are not emulated" if spec.get("initContainers") else None
        self.start_time: str | None = None
        self.deleting = False
        self.stopped = False
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
        volumes = Volumes(self.kubelet.api, self.obj, self.dir, self.kubelet.options.root / "claims")
        while self.volumes is None:
            try:
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
        """argv/env/cwd of the container (probe_argv None) or of one of its exec probes (module doc, rules 1-7)."""
        options = self.kubelet.options
        spec = container.spec
        env = EnvResolver(self.kubelet.api, self.obj).resolve(spec)
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
            out.update(podIP=LOCAL_IP, podIPs=[{"ip": LOCAL_IP}])
        if self.start_time:
            out["startTime"] = self.start_time
        return out


class Kubelet:
    """Admits pods, runs them (PodRunner), writes their status, and finishes graceful deletion.

    A finalizer on every admitted pod keeps a deleted pod `Terminating` until its processes are gone: the
    StatefulSet controller then waits before recreating a pod under the same name, as on a real cluster.
    """

    def __init__(self, api: Api, network: Network, options: ClusterOptions, clock: Clock):
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
            finalizers = meta(pod).get("finalizers") or []
            if runner is None:
                if is_terminating(pod):
                    continue  # deleted before it ran
                runner = self._admit(pod)
                if FINALIZER not in finalizers:
                    await self.api.patch("pods", runner.namespace, runner.name,
                                         {"metadata": {"finalizers": [*finalizers, FINALIZER]}})
            runner.obj = pod
            if is_terminating(pod):
                grace = meta(pod).get("deletionGracePeriodSeconds", runner.grace_seconds)
                runner.begin_stop(self.clock.seconds(grace))
                if runner.stopped:
                    rest = [f for f in finalizers if f != FINALIZER]
                    await self.api.patch("pods", runner.namespace, runner.name,
                                         {"metadata": {"finalizers": rest or None}})
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
            if pod is not None and FINALIZER in (meta(pod).get("finalizers") or []):
                rest = [f for f in meta(pod)["finalizers"] if f != FINALIZER]
                await self.api.patch("pods", runner.namespace, runner.name, {"metadata": {"finalizers": rest or None}})
        if self.session is not None:
            await self.session.close()

    def alive_process_groups(self) -> list[int]:
        """Process groups of containers with a live process, and live processes that left them (by marker)."""
        groups = {pgid for pgid in self.process_groups if group_alive(pgid)}
        return sorted(groups | set(marked_processes(self.markers)))


# ----------------------------------------------------------------------------------- controllers


def new_pod(owner: Obj, template: Obj, name: str, labels: Mapping[str, str], spec_extra: Obj | None = None) -> Obj:
    """A pod from an owner's template, owned by it (the garbage collector deletes it with its owner)."""
    tmeta = template.get("metadata") or {}
    pod_meta: Obj = {"name": name, "namespace": meta(owner).get("namespace") or "default",
                     "labels": {**(tmeta.get("labels") or {}), **labels},
                     "ownerReferences": [owner_reference(owner)]}
    if tmeta.get("annotations"):
        pod_meta["annotations"] = dict(tmeta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
            "spec": {**copy.deepcopy(template.get("spec") or {}), **(spec_extra or {})}}


def _int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


class DeploymentController:
    """Deployments -> pods (no ReplicaSet objects: the Deployment owns its pods; module doc)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, deployments: Sequence[Obj], pods: Sequence[Obj]) -> None:
        for deploy in deployments:
            if not is_terminating(deploy):
                owned = [p for p in pods if owned_by(p, meta(deploy)["uid"])]
                await self._sync_one(deploy, owned)

    async def _sync_one(self, deploy: Obj, pods: list[Obj]) -> None:
        spec = deploy.get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        current = template_hash(spec.get("template") or {})
        active = [p for p in pods if not is_terminating(p)]
        new = [p for p in active if (meta(p).get("labels") or {}).get("pod-template-hash") == current]
        old = [p for p in active if p not in new]
        strategy = spec.get("strategy") or {}
        rolling = strategy.get("rollingUpdate") or {}
        surge = _int_or_percent(rolling.get("maxSurge", "25%"), replicas, round_up=True)
        unavailable = _int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        doomed: list[Obj] = []
        create = 0
        if strategy.get("type") == "Recreate":
            doomed = old
            stale_left = any((meta(p).get("labels") or {}).get("pod-template-hash") != current for p in pods)
            create = 0 if stale_left else max(replicas - len(new), 0)
        else:
            create = max(min(replicas - len(new), replicas + surge - len(active)), 0)
            ready_total = sum(pod_ready(p) for p in active)
            for pod in sorted(old, key=self._deletion_order):
                if not pod_ready(pod):
                    doomed.append(pod)
                elif ready_total - 1 >= replicas - unavailable:
                    doomed.append(pod)
                    ready_total -= 1
        if len(new) > replicas:
            doomed += sorted(new, key=self._deletion_order)[: len(new) - replicas]
        for pod in doomed:
            await self.api.delete("pods", meta(pod)["namespace"], meta(pod)["name"])
        template = spec.get("template") or {}
        for _ in range(create):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            name = f"{meta(deploy)['name']}-{current}-{suffix}"
            await self.api.create(new_pod(deploy, template, name, {"pod-template-hash": current}))
        await self._write_status(deploy, replicas, new, active, unavailable, current)

    @staticmethod
    def _deletion_order(pod: Obj) -> tuple:
        """Unready pods first, then the newest (what a ReplicaSet deletes first)."""
        return (pod_ready(pod), [-ord(ch) for ch in meta(pod).get("creationTimestamp", "")])

    async def _write_status(self, deploy: Obj, replicas: int, new: list[Obj], active: list[Obj],
                            unavailable: int, current: str) -> None:
        ready = sum(pod_ready(p) for p in active)
        updated = len(new)
        old = deploy.get("status") or {}
        available_ok = ready >= replicas - unavailable
        complete = updated == replicas and len(active) == replicas and ready == replicas
        status = omit_zero({
            "observedGeneration": meta(deploy).get("generation", 1), "replicas": len(active),
            "updatedReplicas": updated, "readyReplicas": ready, "availableReplicas": ready,
            "unavailableReplicas": max(replicas - ready, 0),
            "conditions": conditions(old.get("conditions") or [], [
                ("Available", available_ok, "MinimumReplicasAvailable" if available_ok
                 else "MinimumReplicasUnavailable", "Deployment has minimum availability." if available_ok
                 else "Deployment does not have minimum availability."),
                ("Progressing", True, "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
                 f'ReplicaSet "{meta(deploy)["name"]}-{current}" '
                 f'{"has successfully progressed" if complete else "is progressing"}.')]),
        }, ["replicas", "updatedReplicas", "readyReplicas", "availableReplicas", "unavailableReplicas"])
        for cond in status["conditions"]:
            prev: Obj = next((c for c in old.get("conditions") or [] if c.get("type") == cond["type"]), {})
            same = prev.get("reason") == cond.get("reason") and prev.get("status") == cond["status"]
            cond["lastUpdateTime"] = prev.get("lastUpdateTime") if same and prev.get("lastUpdateTime") else rfc3339()
        await self.api.replace_status("deployments", deploy, status)


class StatefulSetController:
    """StatefulSets -> ordinal pods and their PVCs (module doc)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, sets: Sequence[Obj], pods: Sequence[Obj], claims: Sequence[Obj]) -> None:
        for sts in sets:
            if not is_terminating(sts):
                owned = [p for p in pods if owned_by(p, meta(sts)["uid"])]
                await self._sync_one(sts, owned, claims)

    @staticmethod
    def ordinal(sts: Obj, pod: Obj) -> int | None:
        prefix = meta(sts)["name"] + "-"
        name = meta(pod)["name"]
        tail = name[len(prefix):] if name.startswith(prefix) else ""
        return int(tail) if tail.isdigit() else None

    async def _sync_one(self, sts: Obj, owned: list[Obj], claims: Sequence[Obj]) -> None:
        spec = sts.get("spec") or {}
        name, namespace = meta(sts)["name"], meta(sts).get("namespace") or "default"
        replicas = int(spec.get("replicas", 1))
        revision = f"{name}-{template_hash(spec.get('template') or {})}"
        parallel = spec.get("podManagementPolicy") == "Parallel"
        pods = {i: p for p in owned if (i := self.ordinal(sts, p)) is not None}
        await self._sync_claims(sts, pods, replicas, claims)
        terminating = any(is_terminating(p) for p in pods.values())

        for i in range(replicas):  # create
            if i in pods:
                continue
            if not parallel and not all(j in pods and pod_ready(pods[j]) and not is_terminating(pods[j])
                                        for j in range(i)):
                break
            pods[i] = await self.api.create(self._pod(sts, i, revision))
            if not parallel:
                break
        condemned = sorted((i for i in pods if i >= replicas and not is_terminating(pods[i])), reverse=True)
        if condemned and (parallel or not terminating):  # scale down, highest ordinal first
            for i in condemned if parallel else condemned[:1]:
                await self.api.delete("pods", namespace, meta(pods[i])["name"])
        elif ((spec.get("updateStrategy") or {}).get("type", "RollingUpdate") == "RollingUpdate"
              and not terminating and all(i in pods for i in range(replicas))):
            partition = int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition", 0))
            for i in range(replicas - 1, partition - 1, -1):  # roll from the highest ordinal, one at a time
                if (meta(pods[i]).get("labels") or {}).get("controller-revision-hash") != revision:
                    await self.api.delete("pods", namespace, meta(pods[i])["name"])
                    break
                if not pod_ready(pods[i]):
                    break
        await self._write_status(sts, list(pods.values()), revision, replicas)

    def _pod(self, sts: Obj, ordinal: int, revision: str) -> Obj:
        spec = sts.get("spec") or {}
        name = f"{meta(sts)['name']}-{ordinal}"
        template = copy.deepcopy(spec.get("template") or {})
        volumes = [v for v in (template.get("spec") or {}).get("volumes") or []
                   if v["name"] not in {meta(t)["name"] for t in spec.get("volumeClaimTemplates") or []}]
        volumes += [{"name": meta(t)["name"], "persistentVolumeClaim":
                     {"claimName": f"{meta(t)['name']}-{name}"}} for t in spec.get("volumeClaimTemplates") or []]
        extra: Obj = {"hostname": name}
        if spec.get("serviceName"):
            extra["subdomain"] = spec["serviceName"]
        if volumes:
            extra["volumes"] = volumes
        labels = {"controller-revision-hash": revision, "statefulset.kubernetes.io/pod-name": name,
                  "apps.kubernetes.io/pod-index": str(ordinal)}
        return new_pod(sts, template, name, labels, extra)

    async def _sync_claims(self, sts: Obj, pods: Mapping[int, Obj], replicas: int, claims: Sequence[Obj]) -> None:
        """Create missing claims; apply the retention policy (ownerReferences, whenScaled deletion)."""
        spec = sts.get("spec") or {}
        namespace = meta(sts).get("namespace") or "default"
        policy = spec.get("persistentVolumeClaimRetentionPolicy") or {}
        owned = policy.get("whenDeleted") == "Delete"
        existing = {meta(c)["name"]: c for c in claims if (meta(c).get("namespace") or "default") == namespace}
        for template in spec.get("volumeClaimTemplates") or []:
            prefix = f"{meta(template)['name']}-{meta(sts)['name']}-"
            if policy.get("whenScaled") == "Delete":  # claims of removed ordinals, once their pod is gone
                for claim_name in existing:
                    tail = claim_name[len(prefix):] if claim_name.startswith(prefix) else ""
                    if tail.isdigit() and int(tail) >= replicas and int(tail) not in pods:
                        await self.api.delete("persistentvolumeclaims", namespace, claim_name)
            for i in range(replicas):
                claim_name = prefix + str(i)
                claim = existing.get(claim_name)
                if claim is None:
                    claim_meta: Obj = {"name": claim_name, "namespace": namespace,
                                       "labels": dict(meta(template).get("labels") or {})}
                    if owned:
                        claim_meta["ownerReferences"] = [{**owner_reference(sts), "controller": False}]
                    await self.api.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                           "metadata": claim_meta, "spec": copy.deepcopy(template.get("spec") or {})})
                elif owned != owned_by(claim, meta(sts)["uid"]):
                    refs = [r for r in meta(claim).get("ownerReferences") or [] if r.get("uid") != meta(sts)["uid"]]
                    refs += [{**owner_reference(sts), "controller": False}] if owned else []
                    await self.api.patch("persistentvolumeclaims", namespace, claim_name,
                                         {"metadata": {"ownerReferences": refs or None}})

    async def _write_status(self, sts: Obj, pods: list[Obj], revision: str, replicas: int) -> None:
        active = [p for p in pods if not is_terminating(p)]
        old = sts.get("status") or {}
        updated = sum((meta(p).get("labels") or {}).get("controller-revision-hash") == revision for p in active)
        current_rev = revision if updated == replicas else old.get("currentRevision", revision)
        current = sum((meta(p).get("labels") or {}).get("controller-revision-hash") == current_rev for p in active)
        ready = sum(pod_ready(p) for p in active)
        status = omit_zero({"observedGeneration": meta(sts).get("generation", 1), "replicas": len(active),
                            "readyReplicas": ready, "currentReplicas": current, "updatedReplicas": updated,
                            "availableReplicas": ready, "currentRevision": current_rev, "updateRevision": revision,
                            "collisionCount": 0},
                           ["readyReplicas", "currentReplicas", "updatedReplicas", "collisionCount"])
        await self.api.replace_status("statefulsets", sts, status)


class ClaimBinder:
    """Every PersistentVolumeClaim binds at once (a dynamic provisioner with an instant disk)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, claims: Sequence[Obj]) -> None:
        for claim in claims:
            spec = claim.get("spec") or {}
            status = {"phase": "Bound", "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                      "capacity": dict((spec.get("resources") or {}).get("requests") or {"storage": "1Gi"})}
            if (claim.get("status") or {}).get("phase") != "Bound":
                await self.api.replace_status("persistentvolumeclaims", claim, status)


# ----------------------------------------------------------------------------------- kubectl tables


def _pod_cells(pod: Obj) -> list[Any]:
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


def _deployment_cells(d: Obj) -> list[Any]:
    status = d.get("status") or {}
    return [f"{status.get('readyReplicas', 0)}/{(d.get('spec') or {}).get('replicas', 1)}",
            status.get("updatedReplicas", 0), status.get("availableReplicas", 0)]


def _statefulset_cells(s: Obj) -> list[Any]:
    return [f"{(s.get('status') or {}).get('readyReplicas', 0)}/{(s.get('spec') or {}).get('replicas', 1)}"]


def _service_cells(s: Obj) -> list[Any]:
    spec = s.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    return [spec.get("type", "ClusterIP"), spec.get("clusterIP", LOCAL_IP), "<none>", ports or "<none>"]


def _claim_cells(c: Obj) -> list[Any]:
    return [(c.get("status") or {}).get("phase", "Pending"),
            ((c.get("status") or {}).get("capacity") or {}).get("storage", "")]


def _selector_text(selector: Obj | None) -> str:
    """A label selector as kubectl prints it (`metav1.FormatLabelSelector`): `k=v,k2=v2`, `k in (a,b)`."""
    selector = selector or {}
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, values = expr.get("operator", ""), ",".join(expr.get("values") or [])
        parts.append({"In": f"{expr['key']} in ({values})", "NotIn": f"{expr['key']} notin ({values})",
                      "Exists": expr["key"], "DoesNotExist": f"!{expr['key']}"}.get(op, f"{expr['key']} {op}"))
    return ",".join(parts) or "<none>"


def _network_policy_cells(np: Obj) -> list[Any]:
    return [_selector_text((np.get("spec") or {}).get("podSelector"))]


def _disruption_budget_cells(pdb: Obj) -> list[Any]:
    spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
    return [spec.get("minAvailable", "N/A"), spec.get("maxUnavailable", "N/A"), status.get("disruptionsAllowed", 0)]


def _columns(*specs: tuple[str, str]) -> list[Obj]:
    return [{"name": n, "type": t, "format": "", "description": n} for n, t in specs]


# Discovery short names and the `all` category, as a real API server lists them (`kubectl get deploy,sts`).
SHORT_NAMES: dict[str, tuple[set[str], bool]] = {
    "v1/pods": ({"po"}, True), "v1/services": ({"svc"}, True), "v1/persistentvolumeclaims": ({"pvc"}, False),
    "v1/configmaps": ({"cm"}, False), "v1/events": ({"ev"}, False), "v1/namespaces": ({"ns"}, False),
    "apps/v1/deployments": ({"deploy"}, True), "apps/v1/statefulsets": ({"sts"}, True),
    "networking.k8s.io/v1/networkpolicies": ({"netpol"}, False), "policy/v1/poddisruptionbudgets": ({"pdb"}, False),
}

PRINTERS: dict[str, tuple[list[Obj], Callable[[Obj], list[Any]]]] = {
    "pods": (_columns(("Ready", "string"), ("Status", "string"), ("Restarts", "integer")), _pod_cells),
    "deployments": (_columns(("Ready", "string"), ("Up-to-date", "integer"), ("Available", "integer")),
                    _deployment_cells),
    "statefulsets": (_columns(("Ready", "string")), _statefulset_cells),
    "services": (_columns(("Type", "string"), ("Cluster-IP", "string"), ("External-IP", "string"),
                          ("Port(s)", "string")), _service_cells),
    "persistentvolumeclaims": (_columns(("Status", "string"), ("Capacity", "string")), _claim_cells),
    # stored and listed, not enforced (module doc): `kubectl get netpol,pdb` shows what a job asked for
    "networkpolicies": (_columns(("Pod-Selector", "string")), _network_policy_cells),
    "poddisruptionbudgets": (_columns(("Min Available", "string"), ("Max Unavailable", "string"),
                                      ("Allowed Disruptions", "integer")), _disruption_budget_cells),
}


def register_kubectl_tables(emu: KubeEmulator) -> None:
    """Give `kubectl get` on `emu` the columns, short names and `all` category above (idempotent): what
    a cluster shows; also for tests that need the tables but run no pods."""
    printers = getattr(emu, "printers", None)
    if isinstance(printers, dict):
        printers.update(PRINTERS)
    for key, (short, in_all) in SHORT_NAMES.items():
        info = emu.resources[key]
        info.shortnames.update(short)
        if in_all:
            info.categories.add("all")


# ----------------------------------------------------------------------------------- the cluster


class KubeCluster:
    """Controllers, kubelet and kube-proxy running against a KubeEmulator (module doc); an async context manager.

    Objects come from anywhere (kubectl, the operator, `create`); every `tick` seconds the cluster reads
    them and acts. Errors inside the cluster's own loop are kept in `errors` (a test should assert it is
    empty) rather than stopping it.
    """

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
        self._task = asyncio.create_task(self._loop(), name="kube-cluster")

    async def stop(self) -> None:
        """Stop the loop, kill every pod's processes (SIGTERM, `shutdown_grace`, SIGKILL), close the proxies."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.kubelet.shutdown(self.shutdown_grace)
        await self.network.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the emulation: keep it for the test to see
                error = traceback.format_exc()
                if not self.errors or self.errors[-1] != error:
                    self.errors.append(error)
            await asyncio.sleep(self.options.tick)

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
        obj = self.api.get("persistentvolumeclaims", namespace, claim)
        if obj is None:
            raise KeyError(f"no PersistentVolumeClaim {namespace}/{claim}")
        return Volumes(self.api, {"metadata": {"namespace": namespace}}, self.options.root,
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
                         f"terminating={is_terminating(pod)} cells={_pod_cells(pod)}")
            for cs in status.get("containerStatuses") or []:
                lines.append(f"  {cs['name']}: state={cs.get('state')} last={cs.get('lastState')}")
                tail = self.log(meta(pod)["namespace"], meta(pod)["name"], cs["name"])[-1500:]
                lines += [f"    | {line}" for line in tail.splitlines()[-15:]]
        lines += [f"event {e}" for e in self.kubelet.events[-20:]]
        lines += [f"error {e}" for e in self.errors]
        return "\n".join(lines)


