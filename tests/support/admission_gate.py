"""Hold a request mid-flight at a real kube-apiserver: a validating admission webhook served by the test.

A request the webhook's rule matches, from one of the `users` held, waits at admission until the test
calls `release()` (or the webhook's timeout passes); every other request it sees is allowed at once.
This is how a request is slow on a real cluster (a slow webhook): a status write racing another writer,
a create in flight when the operator is killed, a leader whose Lease renewals stall in a partition.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncrl.infra.net import free_port
from tests.support.control_plane import ControlPlane
from tests.support.polling import poll

TIMEOUT_S = 30  # the longest the apiserver lets a webhook take


@dataclass(frozen=True)
class Rule:
    """What to hold: as a webhook rule says it (operations CREATE/UPDATE/DELETE; a PATCH is an UPDATE)."""

    group: str
    resource: str  # plural, or plural/subresource
    operations: tuple[str, ...]
    version: str = "v1"


@dataclass
class AdmissionGate:
    """An async context manager: the webhook server, and its ValidatingWebhookConfiguration while open."""

    cp: ControlPlane
    rule: Rule
    users: frozenset[str]
    name: str = "asyncrl-test-gate"
    held: list[dict[str, Any]] = field(default_factory=list)
    """The admission requests held so far (their `request` objects)."""
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    _probed: bool = False

    async def __aenter__(self) -> AdmissionGate:
        cert, key = self.cp.serving_cert(self.name)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(cert, key)
        app = web.Application()
        app.router.add_post("/gate", self._review)
        app.router.add_post("/probe", self._probe)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=tls).start()
        ca = base64.b64encode(self.cp.ca_file.read_bytes()).decode()

        def webhook(name: str, path: str, rule: dict[str, Any]) -> dict[str, Any]:
            return {"name": name, "sideEffects": "None", "failurePolicy": "Ignore", "timeoutSeconds": TIMEOUT_S,
                    "admissionReviewVersions": ["v1"], "rules": [rule],
                    "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}}

        held = {"apiGroups": [self.rule.group], "apiVersions": [self.rule.version],
                "operations": list(self.rule.operations), "resources": [self.rule.resource]}
        # a second webhook of the same configuration sees namespace creations: a server-side dry run of one
        # shows the apiserver has loaded the configuration (it does so a moment after it is stored)
        probe = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["namespaces"]}
        config = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                  "metadata": {"name": self.name},
                  "webhooks": [webhook("gate.asyncrl.test", "/gate", held),
                               webhook("probe.asyncrl.test", "/probe", probe)]}
        await asyncio.to_thread(self.cp.kubectl, "apply", "-f", "-", stdin=json.dumps(config), check=True)
        await poll(self._loaded, timeout=30, what="the apiserver calling the gate's webhooks")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()
        await asyncio.to_thread(self.cp.kubectl, "delete", "validatingwebhookconfiguration", self.name,
                                "--wait=false")
        if self._runner is not None:
            await self._runner.cleanup()

    def release(self) -> None:
        """Let every held request, and every later one, through."""
        self._open.set()

    async def _loaded(self) -> bool:
        await asyncio.to_thread(self.cp.kubectl, "create", "namespace", "gate-probe", "--dry-run=server")
        return self._probed

    async def _review(self, request: web.Request) -> web.Response:
        admission = (await request.json())["request"]
        if admission["userInfo"]["username"] in self.users and not self._open.is_set():
            self.held.append(admission)
            try:
                await asyncio.wait_for(self._open.wait(), TIMEOUT_S - 2)
            except TimeoutError:
                pass
        return allowed(admission)

    async def _probe(self, request: web.Request) -> web.Response:
        self._probed = True
        return allowed((await request.json())["request"])


def allowed(admission: dict[str, Any]) -> web.Response:
    return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                              "response": {"uid": admission["uid"], "allowed": True}})
