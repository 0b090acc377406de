"""A Kubernetes API emulator good enough to host a real kopf operator and a real kubectl.

kmock's KubernetesEmulator (PyPI `kmock`) keeps objects in memory and streams watch events, but as
shipped it cannot host kopf or kubectl. This test-side subclass fixes exactly
what they need:

- `/api/v1/namespaces[/<name>]` (kmock's path parser raises on them: HTTP 500) are served here;
- server-set metadata: `uid`, `resourceVersion` (global counter), `creationTimestamp`,
  `generation` (bumped on non-metadata/status changes), `metadata.namespace` from the URL;
- status isolation: a `/status` patch changes only `.status`, a main-resource patch never does;
- optimistic concurrency: a patch or PUT carrying a stale `metadata.resourceVersion` gets 409 Conflict;
- the `scale` subresource (autoscaling/v1 Scale) mapped through the CRD's scale paths;
- lists carry `kind`/`apiVersion`/`resourceVersion` and honour `labelSelector`;
- core discovery says `groupVersion: v1` (kmock says `/v1`);
- PUT (replace), finalizers, and a minimal cascading garbage collector over ownerReferences;
- `Accept: ...;as=Table` answers with a Table from the CRD's printer columns (kubectl get);
- a request log (verb, group, resource, bearer token) for the RBAC test, and gates to hold a request mid-flight;
- no unbounded request history: kmock keeps every request and scans them all per reaction (quadratic
  in a long cluster test), so a request is dropped from it once answered (`log` is what tests read).

Still missing (not needed by our tests): schema defaulting/validation, CEL, openapi, protobuf,
server-side apply, field selectors, watch bookmarks and resourceVersion-resumed watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock

from asyncrl.crd import PRINTER_COLUMNS, build_crd
from asyncrl.spec import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from tests.support.merge_patch import merge_patch

# (group, version, plural) -> (kind, namespaced, subresources)
STANDARD_RESOURCES: dict[tuple[str, str, str], tuple[str, bool, tuple[str, ...]]] = {
    ("", "v1", "configmaps"): ("ConfigMap", True, ()),
    ("", "v1", "secrets"): ("Secret", True, ()),
    ("", "v1", "services"): ("Service", True, ("status",)),
    ("", "v1", "persistentvolumeclaims"): ("PersistentVolumeClaim", True, ("status",)),
    ("", "v1", "pods"): ("Pod", True, ("status",)),
    ("", "v1", "events"): ("Event", True, ()),
    ("", "v1", "namespaces"): ("Namespace", False, ("status",)),
    ("apps", "v1", "deployments"): ("Deployment", True, ("status", "scale")),
    ("apps", "v1", "statefulsets"): ("StatefulSet", True, ("status", "scale")),
    ("networking.k8s.io", "v1", "networkpolicies"): ("NetworkPolicy", True, ()),
    ("policy", "v1", "poddisruptionbudgets"): ("PodDisruptionBudget", True, ("status",)),
    ("coordination.k8s.io", "v1", "leases"): ("Lease", True, ()),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): ("CustomResourceDefinition", False, ("status",)),
    (GROUP, VERSION, PLURAL): (KIND, True, ("status", "scale")),
}
# plural -> (spec replicas path, status replicas path, selector path)
SCALE_PATHS = {
    PLURAL: ("spec.rollout.replicas", "status.rollout.ready", "status.rollout.selector"),
    "deployments": ("spec.replicas", "status.replicas", None),
    "statefulsets": ("spec.replicas", "status.replicas", None),
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class LoggedRequest:
    verb: str
    agent: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None
    token: str = ""  # the bearer token: which client (of several kubeconfigs) sent it


def _err(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def _get_path(obj: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _set_path(obj: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    obj[keys[-1]] = value


def _match_selector(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.rstrip("=")) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(value: Any) -> str:
    """A creation time as kubectl's AGE column shows it (the server renders Table cells)."""
    try:
        then = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    secs = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{max(secs, 0)}s"


_NS_PATH = re.compile(r"^/api/v1/namespaces(?:/(?P<name>[^/]+))?/?$")


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour kopf and kubectl rely on (see module doc)."""

    log: list[LoggedRequest] = attrs.field(factory=list, init=False)
    gates: dict[tuple[str, str], asyncio.Event] = attrs.field(factory=dict, init=False)
    # plural -> (extra column definitions, obj -> their cells): `kubectl get` columns (tests/support/kube_cluster/)
    printers: dict[str, Any] = attrs.field(factory=dict, init=False)
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _namespaces: set[str] = attrs.field(factory=lambda: {"default"}, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for (group, version, plural), (kind, namespaced, subs) in STANDARD_RESOURCES.items():
            key = f"{group}/{version}/{plural}" if group else f"{version}/{plural}"
            info = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                           subresources=set(subs), singular=kind.lower())
            if plural == PLURAL:
                info = kmock.ResourceInfo(kind=KIND, namespaced=True, verbs=VERBS, subresources=set(subs),
                                               singular=SINGULAR, shortnames=set(SHORT_NAMES),
                                               categories={"all", "asyncrl"})
            self.resources[key] = info
        # The AsyncRLJob CRD is installed (kubectl reads it for client-side validation).
        crd = build_crd()
        crd["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion="1", generation=1)
        crd["status"] = {"acceptedNames": crd["spec"]["names"], "storedVersions": [VERSION],
                         "conditions": [{"type": "Established", "status": "True"}]}
        self.objects[(kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
                      None, crd["metadata"]["name"])] = crd

    # ------------------------------------------------------------------ entry point

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        m = _NS_PATH.match(raw_request.path)
        if m is None:
            return await super().__call__(raw_request)
        await raw_request.read()
        name = m.group("name")
        if raw_request.method == "GET" and name is None:
            items = [self._namespace(n) for n in sorted(self._all_namespaces())]
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": str(next(self._rv))}, "items": items})
        if raw_request.method == "GET" and name in self._all_namespaces():
            return aiohttp.web.json_response(self._namespace(name))
        if raw_request.method == "POST":
            body = await raw_request.json()
            self._namespaces.add(body["metadata"]["name"])
            return aiohttp.web.json_response(self._namespace(body["metadata"]["name"]), status=201)
        return await self._render_error(_err(404, "NotFound", f'namespaces "{name}" not found'))

    def _all_namespaces(self) -> set[str]:
        return self._namespaces | {ns for (_, ns, _) in self.objects if ns}

    @staticmethod
    def _namespace(name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "uid": f"ns-{name}"},
                "status": {"phase": "Active"}}

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock keeps every request it was sent and finds a request's reaction by scanning that whole
        # history once per reaction: quadratic, it took 3/4 of the test process's CPU in a cluster test.
        # Nothing here reads that history (`log` is ours), so a request leaves it once answered.
        try:
            return await self._dispatch(request)
        finally:
            with contextlib.suppress(ValueError):
                self._requests.remove(request)

    async def _dispatch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await kmock.RawHandler._handle(self, request)  # discovery and plain HTTP
        res = request.resource
        verb = self._verb(request)
        resource = f"{res.plural}/{request.subresource}" if request.subresource else res.plural
        agent = request.headers.get("User-Agent", "")
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        self.log.append(LoggedRequest(verb, agent, res.group, resource, request.namespace, request.name, token))
        gate = self.gates.get((verb, resource))
        if gate is not None:
            await gate.wait()
        if request.subresource == "scale":
            return aiohttp.web.json_response(await self._scale(request))
        if verb in ("create", "patch", "update", "delete"):
            try:
                status, payload = await self._mutate(request, verb)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
            return aiohttp.web.json_response(payload, status=status)
        if self._wants_table(request) and verb in ("get", "list"):
            return aiohttp.web.json_response(await self._table(request, verb))
        # get/list/watch are served by kmock's fallbacks, reading the objects we keep.
        return await kmock.RawHandler._handle(self, request)

    @staticmethod
    def _verb(request: kmock.Request) -> str:
        if request.action == kmock.action.WATCH:
            return "watch"
        if request.method == kmock.method.PUT:
            return "update"
        if request.action is not None:
            return {"list": "list", "fetch": "get", "create": "create", "update": "patch",
                    "delete": "delete"}[request.action.value.lower()]
        return request.method.value.lower()

    # ------------------------------------------------------------------ writes

    def _key(self, request: kmock.Request, name: str | None = None) -> tuple:
        return (request.resource, request.namespace, name or request.name)

    def _kind(self, request: kmock.Request) -> tuple[str, str]:
        res = request.resource
        kind = STANDARD_RESOURCES.get((res.group, res.version, res.plural), (res.plural.capitalize(),))[0]
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        return kind, api_version

    async def _emit(self, resource: Any, event: str, raw: dict) -> None:
        await self._buses[resource].put({"type": event, "object": copy.deepcopy(raw)})

    async def _mutate(self, request: kmock.Request, verb: str) -> tuple[int, dict]:
        async with self._lock:
            if verb == "create":
                return 201, await self._create(request)
            key = self._key(request)
            if key not in self.objects or self.objects[key].deleted:
                raise _err(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            if verb == "delete":
                return 200, await self._delete(key)
            return 200, await self._update(request, key, replace=(verb == "update"))

    async def _create(self, request: kmock.Request) -> dict:
        obj = copy.deepcopy(request.data or {})
        meta = obj.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        if not meta.get("name"):  # as the API server does: generateName + 5 random characters, else 422
            if not meta.get("generateName"):
                raise _err(422, "Invalid", f"{request.resource.plural}: metadata.name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (request.resource, meta.get("namespace"), meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            raise _err(409, "AlreadyExists", f'{request.resource.plural} "{meta.get("name")}" already exists')
        kind, api_version = self._kind(request)
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", kind)
        obj.pop("status", None) if request.resource.plural == PLURAL else None
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(next(self._rv)),
                    generation=1)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._emit(request.resource, "ADDED", obj)
        return obj

    async def _update(self, request: kmock.Request, key: tuple, *, replace: bool) -> dict:
        stored = self.objects[key]
        old = copy.deepcopy(stored.raw)
        body = copy.deepcopy(request.data)
        sub = request.subresource
        # Optimistic concurrency, as the API server does it: a patch or PUT that carries
        # metadata.resourceVersion applies only to that version of the object.
        wanted = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if wanted and str(wanted) != str(old["metadata"].get("resourceVersion")):
            raise _err(409, "Conflict", f'Operation cannot be fulfilled on {request.resource.plural} '
                       f'"{request.name}": the object has been modified; please apply your changes to the '
                       'latest version and try again')
        if replace:
            new = body
        elif isinstance(body, dict) and sub == "status":
            new = merge_patch(old, {"status": body.get("status")}) if "status" in body else old
        elif isinstance(body, dict):
            body.pop("status", None)
            new = merge_patch(old, body)
        else:  # JSON patch; a failed `test` op (kopf's resourceVersion precondition) is a 422
            import jsonpatch

            try:
                new = merge_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise _err(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from None
        new = copy.deepcopy(dict(new))
        if sub == "status":
            new = {**old, "status": new.get("status")}
        elif "status" in old or replace:
            new["status"] = old.get("status")
            if new["status"] is None:
                new.pop("status")
        meta = new.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if k in old["metadata"]:
                meta[k] = old["metadata"][k]
        meta["resourceVersion"] = old["metadata"].get("resourceVersion")
        meta["generation"] = old["metadata"].get("generation", 1)
        if new == old:
            return old
        content = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if content(new) != content(old):
            meta["generation"] += 1
        meta["resourceVersion"] = str(next(self._rv))
        stored.create(new) if stored.deleted else stored.history.append(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored.delete()
            await self._emit(request.resource, "DELETED", new)
            await self._collect(meta.get("uid"))
        else:
            await self._emit(request.resource, "MODIFIED", new)
        return new

    async def _delete(self, key: tuple) -> dict:
        stored = self.objects[key]
        obj = copy.deepcopy(stored.raw)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = _now()
                meta["resourceVersion"] = str(next(self._rv))
                stored.history.append(obj)
                await self._emit(key[0], "MODIFIED", obj)
            return obj
        stored.delete()
        await self._emit(key[0], "DELETED", obj)
        await self._collect(meta.get("uid"))
        return obj

    async def _collect(self, owner_uid: str | None) -> None:
        """Cascading deletion: remove every object owned by `owner_uid` (background propagation)."""
        if not owner_uid:
            return
        for key in list(self.objects):
            obj = self.objects[key]
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                await self._delete(key)

    # ------------------------------------------------------------------ scale

    async def _scale(self, request: kmock.Request) -> dict:
        spec_path, status_path, selector_path = SCALE_PATHS[request.resource.plural]
        key = self._key(request)
        if request.method in (kmock.method.PATCH, kmock.method.PUT):
            replicas = _get_path(request.data, "spec.replicas")
            if not isinstance(replicas, int):
                raise _err(422, "Invalid", "spec.replicas must be an integer")
            patch: dict = {}
            _set_path(patch, spec_path, replicas)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    raise _err(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
                fake = kmock.Request(resource=request.resource, namespace=request.namespace,
                                         name=request.name, data=patch)
                await self._update(fake, key, replace=False)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise _err(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            obj = self.objects[key].raw
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _get_path(obj, status_path) or 0}
        if selector_path and _get_path(obj, selector_path):
            status["selector"] = _get_path(obj, selector_path)
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
                "spec": {"replicas": _get_path(obj, spec_path) or 0}, "status": status}

    # ------------------------------------------------------------------ reads

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        kind, api_version = self._kind(request)
        selector = request.params.get("labelSelector", "")
        async with self._lock:
            items = [copy.deepcopy(o.raw) for (res, ns, _), o in self.objects.items()
                     if res == request.resource and not o.deleted
                     and (request.namespace is None or ns == request.namespace)
                     and _match_selector(o.raw.get("metadata", {}).get("labels") or {}, selector)]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return {"apiVersion": api_version, "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(next(self._rv))}, "items": items}

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        out = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            out["groupVersion"] = request.resource.version  # core: "v1", not "/v1"
        for entry in out.get("resources", []):
            if "/" in entry["name"]:  # subresources carry no short names, categories or list verbs
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return out

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    async def _table(self, request: kmock.Request, verb: str) -> dict:
        if verb == "list":
            objs = (await self._serve_list(request))["items"]
        else:
            key = self._key(request)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    raise _err(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
                objs = [copy.deepcopy(self.objects[key].raw)]
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name"}]
        paths: list[str] = []
        printer = self.printers.get(request.resource.plural)
        if request.resource.plural == PLURAL:
            for col in PRINTER_COLUMNS:
                columns.append({"name": col["name"], "type": col["type"], "format": "",
                                "description": col.get("description", "")})
                paths.append(col["jsonPath"].lstrip("."))
        else:
            columns += printer[0] if printer else []
            columns.append({"name": "Age", "type": "date", "format": "", "description": "Age"})
            paths.append("metadata.creationTimestamp")
        rows = []
        for obj in objs:
            extra = printer[1](obj) if printer and request.resource.plural != PLURAL else []
            cells = [obj["metadata"]["name"], *extra, *[_get_path(obj, p) for p in paths]]
            cells = [_age(c) if col["type"] == "date" else c for c, col in zip(cells, columns)]
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                    "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": "1"},
                "columnDefinitions": columns, "rows": rows}

    # ------------------------------------------------------------------ test helpers

    def get(self, plural: str, namespace: str | None, name: str, group: str | None = None) -> dict | None:
        """The stored object, or None (a deep copy: mutate through `patch_status`)."""
        for (res, ns, nm), obj in self.objects.items():
            if res.plural == plural and ns == namespace and nm == name and (group is None or res.group == group):
                return None if obj.deleted else copy.deepcopy(obj.raw)
        return None

    def all(self, plural: str, namespace: str | None = None) -> list[dict]:
        return [copy.deepcopy(o.raw) for (res, ns, _), o in self.objects.items()
                if res.plural == plural and not o.deleted and (namespace is None or ns == namespace)]

    async def patch_status(self, group: str, version: str, plural: str, namespace: str, name: str,
                           status: dict) -> dict:
        """What a kubelet/controller would do: write `.status` of a child (e.g. readyReplicas)."""
        fake = kmock.Request(resource=kmock.resource(group, version, plural), namespace=namespace,
                                 name=name, subresource="status", data={"status": status},
                                 method=kmock.method.PATCH)
        async with self._lock:
            return await self._update(fake, (fake.resource, namespace, name), replace=False)

    async def put_object(self, group: str, version: str, plural: str, obj: dict) -> dict:
        """Create an object as if a controller did (pods of a Deployment, for instance)."""
        fake = kmock.Request(resource=kmock.resource(group, version, plural),
                                 namespace=obj["metadata"].get("namespace"), data=obj, method=kmock.method.POST)
        async with self._lock:
            return await self._create(fake)

    def kubeconfig(self, path: Any, *, token: str = "emulator") -> None:
        """Write a kubeconfig pointing at this emulator (plain HTTP; the token is not checked, only
        logged, so clients with different kubeconfigs can be told apart in `log`)."""
        server = self.servers[0]
        text = json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator", "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": f"http://{server.host}:{server.port}"}}],
            "users": [{"name": "tester", "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": "default"}}],
        })
        path.write_text(text)
