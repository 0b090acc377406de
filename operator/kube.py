"""The operator's only door to the API server: a small generic REST client plus idempotent apply.

Every call is checked against PERMISSIONS, the single table the Helm chart's ClusterRole is
compared with (tests/packaging/test_helm_chart.py), so the RBAC is exactly what the code uses. The
`kubernetes` client does authentication (in-cluster token or KUBECONFIG); calls run in a thread so
kopf's event loop never blocks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from asyncrl.api.spec import GROUP, PLURAL, VERSION, parse_quantity
from asyncrl.infra.errors import OperatorError
from asyncrl.operator import names as N
from asyncrl.operator.builders import secret_hash, stable_hash

Obj = dict[str, Any]
log = logging.getLogger(__name__)


# Where a rule applies, and so which chart object grants it: JOBS in every namespace the operator
# watches (a ClusterRole when it watches all of them, else one Role per watched namespace), OPERATOR
# only in the operator's own namespace (its leader-election Lease: a Role there). Nothing is
# cluster-scoped: kopf finds its resources by discovery, with no CRD or Namespace watch.
JOBS, OPERATOR = "jobs", "operator"


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: API group, resource (with /subresource), verbs, and where it applies."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    scope: str = JOBS


# Everything the operator does, kopf's own calls included (watching jobs, patching their status,
# posting Events), and what admission requires of it: `update` on asyncrljobs/finalizers, because
# the children's ownerReferences set blockOwnerDeletion (refused without it where the
# OwnerReferencesPermissionEnforcement admission plugin runs, e.g. OpenShift). The chart's RBAC is
# exactly this table (tests/cluster/test_chart_rbac.py, also against the requests of a real operator).
# list/watch on the owned kinds: kopf watches the children (server-side label selector
# names.owned_selector()) so a hand edit or deletion is corrected within seconds.
PERMISSIONS: tuple[Rule, ...] = (
    Rule(GROUP, PLURAL, ("list", "watch", "delete")),  # delete: ttlSecondsAfterFinished
    Rule(GROUP, f"{PLURAL}/status", ("patch",)),
    Rule(GROUP, f"{PLURAL}/finalizers", ("update",)),  # admission (blockOwnerDeletion), see above
    Rule("", "events", ("create",)),
    Rule("", "configmaps", ("get", "create", "patch", "list", "watch")),
    Rule("", "secrets", ("get", "create")),
    Rule("", "services", ("get", "create", "patch", "list", "watch")),
    Rule("", "persistentvolumeclaims", ("get", "create", "patch")),  # patch: metadata only (ownership)
    Rule("", "pods", ("list", "delete")),
    Rule("apps", "deployments", ("get", "create", "patch", "list", "watch")),
    Rule("apps", "statefulsets", ("get", "create", "patch", "list", "watch")),
    Rule("networking.k8s.io", "networkpolicies", ("get", "create", "patch", "list", "watch")),
    Rule("policy", "poddisruptionbudgets", ("get", "create", "patch")),
    # Leader election (asyncrl.operator.leader): one Lease in the operator's own namespace.
    Rule("coordination.k8s.io", "leases", ("get", "create", "update"), OPERATOR),
)

# kind -> (group, version, plural)
KINDS: dict[str, tuple[str, str, str]] = {
    "ConfigMap": ("", "v1", "configmaps"),
    "Secret": ("", "v1", "secrets"),
    "Service": ("", "v1", "services"),
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
    "Pod": ("", "v1", "pods"),
    "Deployment": ("apps", "v1", "deployments"),
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "Lease": ("coordination.k8s.io", "v1", "leases"),
    "AsyncRLJob": (GROUP, VERSION, PLURAL),
}

# How each kind is updated once it exists. None = create-only (a Secret's generated password).
# Otherwise the paths that a merge patch may carry besides our metadata (labels, annotations,
# ownerReferences): a PVC's spec is immutable, so only its metadata (deleteWithJob moves its
# ownerReference); StatefulSets accept changes only to a few spec fields. These paths are also what
# drift correction compares with the live object.
PATCHABLE: dict[str, tuple[str, ...] | None] = {
    "Secret": None,
    "PersistentVolumeClaim": (),
    "ConfigMap": ("data",),
    "Service": ("spec",),
    "NetworkPolicy": ("spec",),
    "PodDisruptionBudget": ("spec",),
    "Deployment": ("spec",),
    "StatefulSet": ("spec.replicas", "spec.template", "spec.updateStrategy",
                    "spec.persistentVolumeClaimRetentionPolicy"),
}

# Pod-template annotations that stand for a live Secret's content (annotation -> the job's Secret
# name): apply fills in the hash of the Secret as it is, so a re-created or edited Secret rolls the
# pods that read it, and Redis and its clients (the trainer and the status mirror) never run with
# different secrets for long.
SECRET_HASH_ANNOTATIONS = {N.ANNOTATION_REDIS_AUTH_HASH: N.redis_secret,
                           N.ANNOTATION_STATUS_AUTH_HASH: N.status_secret,
                           N.ANNOTATION_ENGINE_AUTH_HASH: N.engine_secret}


class NotPermitted(OperatorError, RuntimeError):
    """A call the PERMISSIONS table does not declare: add it there and to the chart, or do not make it."""


class ApiError(OperatorError, RuntimeError):
    """An API call failed; `status` is the HTTP code."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class ChildConflict(OperatorError, RuntimeError):
    """An object of a child's name exists and is not the job's: it is never patched or adopted.

    Without this check a user who may only create AsyncRLJobs could name a job so that a child's
    name is another team's object: the operator would rewrite it and make the job its owner, so
    that deleting the job deletes it (controller-runtime refuses the same: AlreadyOwnedError)."""

    def __init__(self, kind: str, namespace: str, name: str, holder: str):
        super().__init__(f"{kind} {namespace}/{name} exists and is not this job's ({holder}): it is left "
                         f"as it is; delete or rename it, or rename the job")
        self.kind, self.namespace, self.name, self.holder = kind, namespace, name, holder


def foreign_holder(existing: Obj, desired: Obj, owner_uid: str | None = None) -> str | None:
    """Who holds `existing` when it is not the job's own (None when it is).

    The job's own: its controller ownerReference names the job's uid (`owner_uid`, else the uid of
    `desired`'s controller reference); or it has no controller and carries the job's labels (a child
    the job leaves unowned on purpose, such as a weights volume that outlives its job)."""
    if owner_uid is None:
        want: Obj = next((r for r in desired["metadata"].get("ownerReferences") or [] if r.get("controller")), {})
        owner_uid = want.get("uid")
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is not None:
        if owner_uid is not None and controller.get("uid") == owner_uid:
            return None
        return f"controlled by {controller.get('kind')} {controller.get('name')} (uid {controller.get('uid')})"
    labels = existing.get("metadata", {}).get("labels") or {}
    job = desired["metadata"].get("labels", {}).get(N.LABEL_JOB)
    # (either of the two labels naming the job: a hand edit of one is drift to put back, not a stranger)
    names_job = job is not None and job in (labels.get(N.LABEL_JOB), labels.get(N.LABEL_INSTANCE))
    if names_job and labels.get(N.LABEL_MANAGED_BY) == N.MANAGED_BY:
        return None
    return "not created by asyncrl for this job: no ownerReference to it and not its labels"


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(r.group == group and r.resource == resource and verb in r.verbs for r in PERMISSIONS)


def _path(group: str, version: str, plural: str, namespace: str | None, name: str | None = None,
          subresource: str | None = None) -> str:
    base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


def load_config() -> None:
    """In-cluster service account first, then KUBECONFIG / ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    """Generic async CRUD over the Kubernetes REST API (JSON in, JSON out)."""

    def __init__(self, api_client: Any = None):
        self._api = api_client or kubernetes.client.ApiClient()

    async def _call(self, verb: str, method: str, group: str, version: str, plural: str,
                    namespace: str | None, name: str | None = None, *, subresource: str | None = None,
                    body: Any = None, query: list[tuple[str, str]] | None = None,
                    content_type: str = "application/json") -> Any:
        resource = f"{plural}/{subresource}" if subresource else plural
        if not allowed(group, resource, verb):
            raise NotPermitted(f"{verb} {group or 'core'}/{resource} is not in asyncrl.operator.kube.PERMISSIONS")
        path = _path(group, version, plural, namespace, name, subresource)

        def call() -> Any:
            headers = {"Accept": "application/json", "Content-Type": content_type}
            try:
                m, url, hdrs, payload, post = self._api.param_serialize(
                    method=method, resource_path=path, query_params=query or [], header_params=headers,
                    body=body, auth_settings=["BearerToken"])
                resp = self._api.call_api(m, url, header_params=hdrs, body=payload, post_params=post,
                                          _request_timeout=60)
                data = resp.read()
            except ApiException as exc:
                raise ApiError(exc.status or 0, f"{method} {path}: {exc.reason}: {str(exc.body or '')[:300]}") from None
            if resp.status >= 400:
                raise ApiError(resp.status, f"{method} {path}: {data[:300].decode(errors='replace')}")
            return json.loads(data) if data else {}

        return await asyncio.to_thread(call)

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        g, v, p = KINDS[kind]
        try:
            return await self._call("get", "GET", g, v, p, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: Obj) -> Obj:
        g, v, p = KINDS[obj["kind"]]
        return await self._call("create", "POST", g, v, p, obj["metadata"]["namespace"], body=obj)

    async def patch(self, kind: str, namespace: str, name: str, body: Obj, *, subresource: str | None = None) -> Obj:
        g, v, p = KINDS[kind]
        return await self._call("patch", "PATCH", g, v, p, namespace, name, subresource=subresource, body=body,
                                content_type="application/merge-patch+json")

    async def replace(self, obj: Obj) -> Obj:
        """PUT the whole object. With `metadata.resourceVersion` set it is a compare-and-swap: the API
        server answers 409 when the object changed since that version (leader election relies on it)."""
        g, v, p = KINDS[obj["kind"]]
        meta = obj["metadata"]
        return await self._call("update", "PUT", g, v, p, meta["namespace"], meta["name"], body=obj)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        g, v, p = KINDS[kind]
        try:
            await self._call("delete", "DELETE", g, v, p, namespace, name,
                             body={"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        g, v, p = KINDS[kind]
        result = await self._call("list", "GET", g, v, p, namespace, query=[("labelSelector", label_selector)])
        return list((result or {}).get("items") or [])


# ----------------------------------------------------------------------------------- apply


def stamp(obj: Obj) -> Obj:
    """A copy of `obj` carrying the hash of its desired state.

    The hash is what catches a desired change that only removes something (a limit, an argument):
    the live object then still has everything the new desired state sets, so `differences` alone
    would see nothing to do.
    """
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("annotations", {})[N.ANNOTATION_DESIRED_HASH] = stable_hash(obj)
    return out


def _select(obj: Obj, paths: tuple[str, ...]) -> Obj:
    out: Obj = {}
    for path in paths:
        keys = path.split(".")
        src: Any = obj
        for k in keys:
            src = src.get(k) if isinstance(src, dict) else None
        if src is None:
            continue
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = src
    return out


def patch_body(desired: Obj) -> Obj | None:
    """The merge patch that moves an existing object to `desired` (None: the kind is create-only).

    It carries exactly the fields we own: the kind's PATCHABLE paths and our metadata. Lists in it
    (containers, env, ports, ownerReferences) replace the live lists whole.
    """
    paths = PATCHABLE[desired["kind"]]
    if paths is None:
        return None
    meta = desired["metadata"]
    body = _select(desired, paths)
    body["metadata"] = {"labels": meta.get("labels", {}), "annotations": meta.get("annotations", {}),
                        "ownerReferences": meta.get("ownerReferences", [])}
    return body


_QUANTITY_PARENTS = frozenset({"requests", "limits"})


def _empty(value: Any) -> bool:
    """A zero value the API server may leave out of what it returns (`omitempty`)."""
    return value is None or value is False or (not isinstance(value, bool) and value in (0, "", {}, []))


def _same(live: Any, want: Any, parent: str) -> bool:
    if isinstance(live, bool) or isinstance(want, bool):
        return live is want
    if live == want:
        return True
    if parent in _QUANTITY_PARENTS and isinstance(live, (str, int, float)) and isinstance(want, (str, int, float)):
        try:  # the API server writes quantities in canonical form: "0.5" comes back as "500m"
            return parse_quantity(live) == parse_quantity(want)
        except ValueError:
            return False
    return False


def differences(live: Any, desired: Any, path: str = "", *, _key: str = "", _parent: str = "") -> list[str]:
    """Where `live` lacks what `desired` sets: [] means in sync, and nothing needs patching.

    Only what `desired` says is compared. Keys that only the live object has are the API server's
    defaults (imagePullPolicy, terminationMessagePath, a Service's clusterIP, probe thresholds...)
    or another controller's, never ours, so they never count as drift. Lists are ours whole
    (containers, env, args, ports, volumes): same length, element by element. Resource quantities
    compare by value; a zero value that the server omits equals a missing one.
    """
    if isinstance(desired, dict):
        if live is None and not desired:
            return []
        if not isinstance(live, dict):
            return [path or "."]
        out: list[str] = []
        for key, want in desired.items():
            sub = f"{path}.{key}" if path else key
            if key not in live:
                if not _empty(want):
                    out.append(sub)
                continue
            out += differences(live[key], want, sub, _key=key, _parent=_key)
        return out
    if isinstance(desired, list):
        if live is None and not desired:
            return []
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        out = []
        for i, (have, want) in enumerate(zip(live, desired)):
            out += differences(have, want, f"{path}[{i}]", _key=_key, _parent=_parent)
        return out
    if live is None and _empty(desired):
        return []
    return [] if _same(live, desired, _parent) else [path]


def _template_annotations(obj: Obj | None) -> Obj:
    template = ((obj or {}).get("spec") or {}).get("template") or {}
    return dict((template.get("metadata") or {}).get("annotations") or {})


async def with_live_secret_hashes(kube: Kube, obj: Obj, existing: Obj | None) -> Obj:
    """`obj` with its SECRET_HASH_ANNOTATIONS set from the Secrets as they are in the cluster.

    A Secret that is missing right now (deleted since it was applied) keeps the live object's value:
    the Secret's own watch event brings the pass that re-creates it and then rolls the pods.
    """
    wanted = [a for a in SECRET_HASH_ANNOTATIONS if a in _template_annotations(obj)]
    if not wanted:
        return obj
    meta = obj["metadata"]
    job = (meta.get("labels") or {}).get(N.LABEL_JOB)
    if not job:
        return obj
    out = copy.deepcopy(obj)
    annotations = out["spec"]["template"]["metadata"]["annotations"]
    live_annotations = _template_annotations(existing)
    for annotation in wanted:
        secret = await kube.get("Secret", meta["namespace"], SECRET_HASH_ANNOTATIONS[annotation](job))
        if secret is not None:
            annotations[annotation] = secret_hash(secret)
        elif annotation in live_annotations:
            annotations[annotation] = live_annotations[annotation]
    return out


def _refuse_foreign(existing: Obj | None, desired: Obj, owner_uid: str | None) -> None:
    if existing is not None and (holder := foreign_holder(existing, desired, owner_uid)) is not None:
        meta = desired["metadata"]
        raise ChildConflict(desired["kind"], meta["namespace"], meta["name"], holder)


async def apply(kube: Kube, obj: Obj, *, owner_uid: str | None = None) -> tuple[str, Obj]:
    """Create `obj`, or bring the existing object back to it; returns (action, object). Safe to repeat.
    An existing object that is not the job's own (the job of uid `owner_uid`, else of `obj`'s
    controller reference) is never touched: ChildConflict (`foreign_holder`).

    The live object is compared with what we own (`patch_body`: the fields the builders set, plus
    our labels, annotations and ownerReferences). Any difference — a hand edit, a field another
    client changed, a new desired state (the desired-hash annotation) — is patched back; when there
    is none, no request is sent.
    """
    kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
    existing = await kube.get(kind, ns, name)
    _refuse_foreign(existing, obj, owner_uid)
    desired = stamp(await with_live_secret_hashes(kube, obj, existing))
    if existing is None:
        try:
            return "created", await kube.create(desired)
        except ApiError as exc:
            if exc.status != 409:
                raise
            existing = await kube.get(kind, ns, name)  # created by a previous, interrupted attempt
            if existing is None:
                raise
            _refuse_foreign(existing, obj, owner_uid)  # (or by someone else in between)
    body = patch_body(desired)
    if body is None:
        return "unchanged", existing
    drift = differences(existing, body)
    if not drift:
        return "unchanged", existing
    shown = ", ".join(drift[:6]) + (f" (+{len(drift) - 6} more)" if len(drift) > 6 else "")
    log.info(f"{kind} {ns}/{name} differs from the desired state at {shown}: patching")
    return "patched", await kube.patch(kind, ns, name, body)
