"""A small async client of a real kube-apiserver: requests, and list+watch caches (reflectors).

The process kubelet (real_cluster.py) needs a handful of verbs on a handful of resources; aiohttp
with the kubeconfig's client certificate does that without a second client library, and the
reflector keeps an in-memory copy of a resource so the kubelet's parts can read synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from asyncrl.api.spec import API_VERSION, PLURAL
from tests.support.kube_cluster.objects import Obj, meta

# plural -> (API path prefix, namespaced): the resources the process kubelet reads or writes
RESOURCES: dict[str, tuple[str, bool]] = {
    "pods": ("/api/v1", True), "services": ("/api/v1", True), "configmaps": ("/api/v1", True),
    "secrets": ("/api/v1", True), "persistentvolumeclaims": ("/api/v1", True),
    "persistentvolumes": ("/api/v1", False), "nodes": ("/api/v1", False), "events": ("/api/v1", True),
    "serviceaccounts": ("/api/v1", True),
    "leases": ("/apis/coordination.k8s.io/v1", True), "storageclasses": ("/apis/storage.k8s.io/v1", False),
    "deployments": ("/apis/apps/v1", True), "statefulsets": ("/apis/apps/v1", True),
    "replicasets": ("/apis/apps/v1", True), "endpointslices": ("/apis/discovery.k8s.io/v1", True),
    "networkpolicies": ("/apis/networking.k8s.io/v1", True), "poddisruptionbudgets": ("/apis/policy/v1", True),
    PLURAL: (f"/apis/{API_VERSION}", True),
}
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "process-kubelet"  # how the apiserver's audit log names our requests


class ApiError(Exception):
    """A request the apiserver refused: `status` is the HTTP code, the message is the apiserver's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Credentials:
    """Where the apiserver is and how to prove who we are: what a cert-based kubeconfig holds."""

    server: str
    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Credentials:
        config = yaml.safe_load(Path(path).read_text())
        context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        return cls(cluster["server"], cluster["certificate-authority"], user["client-certificate"],
                   user["client-key"])

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def path_of(plural: str, namespace: str | None = None, name: str | None = None,
            subresource: str | None = None) -> str:
    prefix, namespaced = RESOURCES[plural]
    parts = [prefix]
    if namespaced and namespace:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class RestClient:
    """JSON requests to the apiserver; 404 reads as None (the object is gone), other refusals raise ApiError."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context(), limit=0)
        self.session = aiohttp.ClientSession(self.credentials.server, connector=connector,
                                             headers={"User-Agent": USER_AGENT})

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def request(self, method: str, path: str, body: Obj | None = None, *,
                      content_type: str = "application/json", params: Mapping[str, str] | None = None) -> Obj | None:
        assert self.session is not None, "RestClient.open() first"
        data = json.dumps(body).encode() if body is not None else None
        async with self.session.request(method, path, data=data, params=dict(params or {}),
                                        headers={"Content-Type": content_type}) as resp:
            text = await resp.text()
            if resp.status == 404:
                return None
            if resp.status >= 400:
                with contextlib.suppress(ValueError):
                    text = json.loads(text).get("message", text)
                raise ApiError(resp.status, f"{method} {path}: {text}")
            return json.loads(text) if text else {}

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """The events of one watch request, until the apiserver ends it (its timeoutSeconds)."""
        assert self.session is not None, "RestClient.open() first"
        query = {**params, "watch": "1", "allowWatchBookmarks": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with self.session.get(path, params=query, timeout=timeout) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, f"watch {path}: {await resp.text()}")
            buffer = b""
            async for chunk in resp.content.iter_any():  # lines may be longer than aiohttp's readline limit
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)


def key_of(obj: Obj) -> tuple[str | None, str]:
    return meta(obj).get("namespace"), meta(obj)["name"]


class Reflector:
    """An always-current copy of one resource: list, then watch from that resourceVersion; relist when the
    watch expires (410 Gone) or breaks. `synced` is set after the first list."""

    def __init__(self, client: RestClient, plural: str, params: Mapping[str, str] | None = None, *,
                 path: str | None = None):
        self.client, self.plural, self.params = client, plural, dict(params or {})
        self.path = path or path_of(plural)  # `path`: a resource RESOURCES does not name (a custom resource)
        self.items: dict[tuple[str | None, str], Obj] = {}
        self.synced = asyncio.Event()
        self.errors: list[str] = []

    async def run(self) -> None:
        path = self.path
        while True:
            try:
                listed = await self.client.request("GET", path, params=self.params) or {}
                self.items = {key_of(o): o for o in listed.get("items") or []}
                self.synced.set()
                version = meta(listed).get("resourceVersion", "")
                while True:  # each watch ends after timeoutSeconds: resume from the last version seen
                    params = {**self.params, "resourceVersion": version, "timeoutSeconds": "240"}
                    async for event in self.client.watch(path, params):
                        version = self._apply(event, version)
            except asyncio.CancelledError:
                raise
            except _Expired:
                continue
            except (aiohttp.ClientError, ApiError, OSError, ValueError) as exc:
                self.errors = [*self.errors[-99:], f"{self.plural}: {exc!r}"]
                await asyncio.sleep(0.2)

    def _apply(self, event: Obj, version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise _Expired(obj.get("message", ""))  # 410 Gone: the version is too old; list again
        if kind in ("ADDED", "MODIFIED"):
            self.items[key_of(obj)] = obj
        elif kind == "DELETED":
            self.items.pop(key_of(obj), None)
        return meta(obj).get("resourceVersion", version)

    def list(self, namespace: str | None = None) -> list[Obj]:
        return [o for (ns, _), o in self.items.items() if namespace is None or ns == namespace]

    def get(self, namespace: str | None, name: str) -> Obj | None:
        return self.items.get((namespace, name))


class _Expired(Exception):
    """The watch's resourceVersion is gone from the apiserver's window."""
