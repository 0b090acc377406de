"""Ports, DNS and kube-proxy of the test cluster: Service and pod names to local host ports."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.infra.net import free_port
from tests.support.kube_cluster.objects import (
    LOCAL_IP,
    LOOPBACK_HOSTS,
    Obj,
    is_terminating,
    labels_match,
    meta,
    pod_ready,
)


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
            port = free_port(LOCAL_IP)
            while port in taken:
                port = free_port(LOCAL_IP)
            self._ports[key] = port
        return self._ports[key]


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
        self.cluster_ips: dict[str, ServiceName] = {}

    def update(self, services: Sequence[Obj]) -> None:
        self.services = {(meta(s).get("namespace") or "default", meta(s)["name"]): s for s in services}
        self.cluster_ips = {ip: ServiceName(*key) for key, s in self.services.items()
                            for ip in (s.get("spec") or {}).get("clusterIPs") or [] if ip != "None"}

    def _headless(self, namespace: str, name: str) -> bool:
        svc = self.services.get((namespace, name))
        return svc is not None and (svc.get("spec") or {}).get("clusterIP") == "None"

    def lookup(self, host: str, namespace: str, *, in_url: bool = False) -> ServiceName | PodName | None:
        """`in_url`: the host of a URL (`scheme://host:port`), which a client resolves when it connects,
        not when its container starts: a short name there (`<svc>`, `<svc>.<ns>`) is taken for a Service
        the search path will find even before that Service exists (the operator makes children in no
        order a pod can wait for)."""
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
            return ServiceName(namespace, name) if in_url or (namespace, name) in self.services else None
        if len(labels) == 2:
            first, second = labels
            if self._headless(namespace, second):
                return PodName(namespace, first)
            return ServiceName(second, first) if in_url or (second, first) in self.services else None
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
    """Cluster addressing on one host: DNS names, per-pod host ports, and a proxy per Service port.

    `pod_network` (a CIDR) gives each pod name its own IP from it, for the pod's status and the downward
    API; nothing listens there: `<pod IP>:<port>` is rewritten like a pod's DNS name (rule 3). Without
    it every pod's IP is 127.0.0.1 (which a real EndpointSlice controller refuses)."""

    def __init__(self, pod_network: str | None = None) -> None:
        self.dns = Dns()
        self.ports = PortRegistry()
        self.proxies: dict[tuple[str, str, int], ServiceProxy] = {}
        self._free_ips = ipaddress.ip_network(pod_network).hosts() if pod_network else None
        self._ips: dict[tuple[str, str], str] = {}
        self._ip_pods: dict[str, PodName] = {}

    def pod_port(self, namespace: str, pod: str, container_port: int) -> int:
        return self.ports.get(("pod", namespace, pod, int(container_port)))

    def pod_ip(self, namespace: str, pod: str) -> str:
        """The pod's IP, one per pod name for the cluster's life (its host ports are too)."""
        if self._free_ips is None:
            return LOCAL_IP
        if (namespace, pod) not in self._ips:
            ip = str(next(self._free_ips))
            self._ips[(namespace, pod)] = ip
            self._ip_pods[ip] = PodName(namespace, pod)
        return self._ips[(namespace, pod)]

    def service_port(self, namespace: str, service: str, port: int) -> int:
        return self.ports.get(("svc", namespace, service, int(port)))

    def address(self, host: str, port: int, namespace: str, own: Mapping[int, int], *,
                in_url: bool = False) -> str | None:
        """The local `host:port` standing in for a cluster address, or None when it names nothing known
        (`in_url`: see `Dns.lookup`)."""
        if host.lower() in LOOPBACK_HOSTS:
            return f"{host}:{own[port]}" if port in own else None
        target = (self._ip_pods.get(host) or self.dns.cluster_ips.get(host)
                  or self.dns.lookup(host, namespace, in_url=in_url))
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
