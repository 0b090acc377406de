"""A real kube-apiserver with no controllers, scheduler or node (as controller-runtime's envtest does):
the operator tests that play the kubelet and the controllers themselves (they write the workloads'
status) run against the apiserver's own validation, defaulting, admission and audit log.

Nothing makes pods, binds claims, collects garbage or finishes a namespace's deletion here: a test
writes the status a controller would, and checks the operator's requests and the objects as the
apiserver stores them. The scenarios on the full control plane (tests/test_cluster_e2e*.py) show the
cluster-wide effects.

`BareApiserver` is what those tests read and write with (`get`, `all`, `patch_status`, `put_object`,
`post`/`patch`/`delete`, `collect_garbage`, `kubeconfig`, `log`). The operator gets a client certificate
of its own (`kubeconfig`), so the audit log tells its requests from the test's.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncrl.api.spec import PLURAL
from tests.support.control_plane import ControlPlane, running_control_plane
from tests.support.kube_cluster.rest import RESOURCES, path_of
from tests.support.paths import REPO
from tests.support.polling import poll_sync

TEST_AGENT = "asyncrl-tests"
OPERATOR_USER = "asyncrl-operator"


@dataclass(frozen=True)
class AuditedRequest:
    """One answered request, from the audit log."""

    verb: str
    agent: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None
    user: str
    code: int
    uri: str = ""
    """The request's path and query (a watch's label selector is there)."""


class Answer:
    """An HTTP answer shaped as the tests read aiohttp's (`status`, `await json()`, `await text()`)."""

    def __init__(self, response: httpx.Response):
        self.status = response.status_code
        self._response = response

    async def json(self) -> Any:
        return self._response.json()

    async def text(self) -> str:
        return self._response.text


class BareApiserver:
    """Reads and writes as cluster admin (user agent `asyncrl-tests`), over HTTPS with a client cert."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        pki = cp.root / "pki"
        tls = ssl.create_default_context(cafile=str(cp.ca_file))
        tls.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        headers = {"User-Agent": TEST_AGENT}
        self.http = httpx.Client(base_url=cp.server, verify=tls, headers=headers, timeout=30)
        self.async_http = httpx.AsyncClient(base_url=cp.server, verify=tls, headers=headers, timeout=30)

    async def close(self) -> None:
        self.http.close()
        await self.async_http.aclose()

    @staticmethod
    def path(plural: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        return path_of(plural, namespace, name, sub)

    # -- reads (synchronous: tests poll them)

    def get(self, plural: str, namespace: str | None, name: str) -> dict | None:
        resp = self.http.get(self.path(plural, namespace, name))
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def all(self, plural: str, namespace: str | None = None) -> list[dict]:
        resp = self.http.get(self.path(plural, namespace))
        resp.raise_for_status()
        return resp.json()["items"]

    # -- writes (what a kubelet or controller would do)

    async def patch_status(self, group: str, version: str, plural: str, namespace: str, name: str,
                           status: dict) -> dict:
        """Write `.status` of an object, as its controller would (`group`/`version`: the caller's record
        of which API it is; the path comes from the plural)."""
        resp = await self.async_http.patch(self.path(plural, namespace, name, "status"), json={"status": status},
                                           headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def put_object(self, group: str, version: str, plural: str, obj: dict) -> dict:
        """Create an object as a controller would (a pod of a workload, for instance)."""
        resp = await self.async_http.post(self.path(plural, obj["metadata"].get("namespace")), json=obj)
        assert resp.status_code == 201, resp.text
        return resp.json()

    async def collect_garbage(self, namespace: str, owner_uid: str) -> list[str]:
        """Play the garbage collector for a deleted owner: delete the objects of `namespace` whose
        ownerReferences name `owner_uid`; returns `plural/name` of each."""
        gone = []
        for plural, (_, namespaced) in RESOURCES.items():
            if not namespaced or plural in ("events", "leases", PLURAL):
                continue
            for obj in self.all(plural, namespace):
                if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []):
                    name = obj["metadata"]["name"]
                    resp = await self.async_http.delete(self.path(plural, namespace, name))
                    assert resp.status_code in (200, 202, 404), resp.text
                    gone.append(f"{plural}/{name}")
        return gone

    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[Answer]:
        yield Answer(await self.async_http.request(method, url, **kwargs))

    def post(self, url: str, **kwargs: Any) -> contextlib.AbstractAsyncContextManager[Answer]:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> contextlib.AbstractAsyncContextManager[Answer]:
        return self.request("PATCH", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> contextlib.AbstractAsyncContextManager[Answer]:
        return self.request("DELETE", url, **kwargs)

    # -- clients and what they did

    def kubeconfig(self, path: Path, *, user: str = OPERATOR_USER) -> None:
        """Write a kubeconfig for `user` (cluster admin, with a client certificate of its own)."""
        shutil.copy(self.cp.client_kubeconfig(user, f"/O=system:masters/CN={user}"), path)

    @property
    def log(self) -> list[AuditedRequest]:
        """Every answered request, in the order the answers began, as the apiserver's audit log has it (a
        watch is logged when its answer starts streaming, and again when it ends: counted once)."""
        found: dict[str, AuditedRequest] = {}
        for line in self.cp.audit_log.read_text().splitlines():
            event = json.loads(line)
            if event.get("stage") not in ("ResponseStarted", "ResponseComplete"):
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource") or ""
            if ref.get("subresource"):
                resource += "/" + ref["subresource"]
            request = AuditedRequest(event["verb"], event.get("userAgent", ""), ref.get("apiGroup") or "",
                                     resource, ref.get("namespace"), ref.get("name"), event["user"]["username"],
                                     (event.get("responseStatus") or {}).get("code", 0), event.get("requestURI", ""))
            found.setdefault(event["auditID"], request)
        return list(found.values())

    def requests_of(self, user: str = OPERATOR_USER) -> list[AuditedRequest]:
        return [r for r in self.log if r.user == user and r.resource]

    def refused(self, user: str = OPERATOR_USER) -> list[tuple[str, str, int]]:
        """(verb, resource, code) of `user`'s requests the apiserver refused as bad or forbidden. 404 (a
        child not made yet), 409 (a write that lost a race; it reads again) and 429 are the protocol,
        a 5xx the server's (a loaded machine's etcd); a 400, 403 or 422 is the client's fault."""
        return sorted({(r.verb, r.resource, r.code) for r in self.requests_of(user)
                       if 400 <= r.code < 500 and r.code not in (404, 409, 429)})


@contextlib.contextmanager
def bare_apiserver(namespace: str) -> Iterator[BareApiserver]:
    """etcd and kube-apiserver of their own, the CRD installed and `namespace` made (with its `default`
    ServiceAccount, which no controller makes here)."""
    with running_control_plane(controllers=False) as cp:
        cp.kubectl("apply", "-f", str(REPO / "crds" / "asyncrljob.yaml"), check=True)
        poll_sync(lambda: cp.kubectl("get", PLURAL, "-A").returncode == 0, what="the AsyncRLJob API served")
        cp.kubectl("create", "namespace", namespace, check=True)
        cp.kubectl("create", "serviceaccount", "default", "-n", namespace, check=True)
        yield BareApiserver(cp)


@pytest.fixture(name="api")
async def bare_apiserver_fixture() -> AsyncIterator[BareApiserver]:
    """A bare apiserver per test, with the operator tests' namespace (tests.support.operator_jobs.NS)."""
    from tests.support.operator_jobs import NS

    with bare_apiserver(NS) as api:
        try:
            yield api
        finally:
            await api.close()
