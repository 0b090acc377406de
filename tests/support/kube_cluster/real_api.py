"""The kubelet's API (`api.PodApi`) on a real apiserver: reads from watch caches, writes over HTTPS.

Two identities: the cluster's view (`client`, the test's admin: watch caches of everything the test,
the Service proxies and the provisioner read) and the node's (`node`, `system:node:<name>` in
`system:nodes` when the cluster is given one): the kubelet watches the pods bound to its node, reads
the Secrets, ConfigMaps, claims and volumes its pods name one GET each at every container start (the
Node authorizer allows only those), writes `pods/status`, makes the final delete and requests the
pods' ServiceAccount tokens as the node, so the apiserver's Node authorizer and NodeRestriction
admission judge what the kubelet does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.kube_cluster.env import MountError
from tests.support.kube_cluster.objects import Obj, is_terminating, meta
from tests.support.kube_cluster.rest import MERGE_PATCH, RESOURCES, ApiError, Reflector, RestClient, path_of

WATCHED = ("pods", "services", "configmaps", "secrets", "persistentvolumeclaims", "persistentvolumes")
"""The cluster's view: one watch each, cluster-wide (what tests read, and the Service proxies)."""
POD_READS = ("secrets", "configmaps", "persistentvolumeclaims", "persistentvolumes")
"""What the kubelet reads per pod, as the node."""
_IRREGULAR_PLURALS = {"StorageClass": "storageclasses", "EndpointSlice": "endpointslices"}


def plural_of(kind: str) -> str:
    plural = _IRREGULAR_PLURALS.get(kind, kind.lower() + "s")
    if plural not in RESOURCES:
        raise KeyError(f"kind {kind} is not one the process kubelet knows")
    return plural


class RealApi:
    """Reads are synchronous, from reflectors (what kubelet's informers give it); a write is seen by the
    next read only once its watch event has arrived, as for any controller."""

    def __init__(self, client: RestClient, node: RestClient | None = None, node_name: str | None = None):
        self.client = client
        self.node = node or client
        """The kubelet's own identity (the view's, when the cluster has none)."""
        self.reflectors = {plural: Reflector(client, plural) for plural in WATCHED}
        self.node_pods = Reflector(self.node, "pods", {"fieldSelector": f"spec.nodeName={node_name}"}
                                   if node_name else None)
        """The pods bound to the node, watched as the node (the Node authorizer lists no others)."""
        self._pod_reads: dict[str, dict[tuple[str, str], Obj | None]] = {}
        self._tasks: list[asyncio.Task] = []
        self._tokens: dict[tuple[str, str], bytes | str] = {}  # (pod uid, audience) -> token, or why not
        self._token_tasks: dict[tuple[str, str], asyncio.Task] = {}

    async def start(self, timeout: float = 60.0) -> None:
        watches = {**self.reflectors, "node pods": self.node_pods}
        self._tasks = [asyncio.create_task(r.run(), name=f"reflector {p}") for p, r in watches.items()]
        await asyncio.wait_for(asyncio.gather(*(r.synced.wait() for r in watches.values())), timeout)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._token_tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks, *self._token_tasks.values(), return_exceptions=True)
        self._tasks = []

    def watch_errors(self) -> list[str]:
        return [e for r in (*self.reflectors.values(), self.node_pods) for e in r.errors]

    # -- reads (cached)

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return self.reflectors[plural].list(namespace)

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        return self.reflectors[plural].get(namespace if RESOURCES[plural][1] else None, name)

    # -- writes

    async def create(self, obj: Obj, *, client: RestClient | None = None) -> Obj:
        """Create (as `client`, the view by default)."""
        plural = plural_of(obj["kind"])
        created = await (client or self.client).request("POST", path_of(plural, meta(obj).get("namespace")), obj)
        assert created is not None
        return created

    async def patch(self, plural: str, namespace: str | None, name: str, body: Obj,
                    subresource: str | None = None, *, client: RestClient | None = None) -> Obj | None:
        """A JSON merge patch (None deletes a key; as `client`, the view by default); None when the object
        is gone."""
        return await (client or self.client).request("PATCH", path_of(plural, namespace, name, subresource), body,
                                                     content_type=MERGE_PATCH)

    async def replace_status(self, plural: str, obj: Obj, status: Obj) -> None:
        """Write the kubelet's status fields through the status subresource, as the node. Keys it does not
        report stay as the apiserver has them (`qosClass` is computed at creation and immutable)."""
        status = {k: v for k, v in status.items() if k != "qosClass"}
        await self.node.request("PATCH", path_of(plural, meta(obj).get("namespace"), meta(obj)["name"], "status"),
                                {"status": status}, content_type=MERGE_PATCH)

    async def delete(self, plural: str, namespace: str | None, name: str, *, grace: int | None = None,
                     uid: str | None = None, client: RestClient | None = None) -> None:
        """Delete (gracefully unless `grace`; as `client`, the view by default); a `uid` precondition spares
        a newer object of the same name."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await (client or self.client).request("DELETE", path_of(plural, namespace, name), body)
        except ApiError as exc:
            if exc.status != 409:  # 409: the uid changed, that pod is not ours to delete
                raise

    # -- the kubelet's part in a pod's life

    async def release_pod(self, pod: Obj) -> None:
        """A deleted pod's processes are gone: the final delete, grace 0, of exactly this pod (its uid)."""
        self._pod_reads.pop(meta(pod)["uid"], None)
        if is_terminating(pod):
            await self.delete("pods", meta(pod).get("namespace"), meta(pod)["name"], grace=0, uid=meta(pod)["uid"],
                              client=self.node)

    def bound_volume_path(self, claim: Obj) -> Path | None:
        """The hostPath directory of the PersistentVolume the claim is bound to."""
        volume_name = (claim.get("spec") or {}).get("volumeName")
        if not volume_name:
            raise MountError(f'persistentvolumeclaim "{meta(claim)["name"]}" is not bound')
        volume = self.get("persistentvolumes", None, volume_name)
        path = ((volume or {}).get("spec") or {}).get("hostPath", {}).get("path")
        if not path:
            raise MountError(f'persistentvolume "{volume_name}" has no hostPath (yet)')
        return Path(path)

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None:
        """The pod's bound ServiceAccount token (TokenRequest), as kubelet writes it into the projected
        `kube-api-access-*` volume; MountError until the apiserver has issued it (the mount is retried)."""
        audience = request.get("audience") or ""
        key = (meta(pod)["uid"], audience)
        token = self._tokens.get(key)
        if isinstance(token, bytes):
            return token
        task = self._token_tasks.get(key)
        if task is None or task.done():
            self._token_tasks[key] = asyncio.create_task(self._request_token(pod, key, request))
        raise MountError(f"waiting for a ServiceAccount token{f': {token}' if token else ''}")

    async def _request_token(self, pod: Obj, key: tuple[str, str], request: Obj) -> None:
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [key[1]] if key[1] else [], "expirationSeconds": int(request.get("expirationSeconds", 3600)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta(pod)["name"], "uid": key[0]}}}
        try:
            answer = await self.node.request("POST", path_of("serviceaccounts", meta(pod)["namespace"], account,
                                                             "token"), body)
            self._tokens[key] = ((answer or {}).get("status") or {})["token"].encode()
        except (ApiError, OSError, KeyError) as exc:
            self._tokens[key] = repr(exc)

    # -- what a pod names, read as the node

    async def fetch_for(self, pod: Obj) -> None:
        """GET, as the node, every Secret, ConfigMap and claim the pod names and the volume each claim is
        bound to (a kubelet's Get strategy: at each start). Missing or refused (the Node authorizer's
        graph learns a new binding a moment late) reads as absent: the mount or start is retried."""
        namespace = meta(pod).get("namespace") or "default"
        reads: dict[tuple[str, str], Obj | None] = {}
        for plural, name in sorted(pod_references(pod)):
            reads[(plural, name)] = await self._node_get(plural, namespace, name)
            volume = ((reads[(plural, name)] or {}).get("spec") or {}).get("volumeName")
            if plural == "persistentvolumeclaims" and volume:
                reads[("persistentvolumes", volume)] = await self._node_get("persistentvolumes", None, volume)
        self._pod_reads[meta(pod)["uid"]] = reads

    async def _node_get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return await self.node.request("GET", path_of(plural, namespace, name))
        except ApiError:
            return None

    def reads_for(self, pod: Obj) -> PodReads:
        return PodReads(self, self._pod_reads.get(meta(pod)["uid"], {}))


class PodReads:
    """One pod's objects as its kubelet last read them (`RealApi.fetch_for`): what its env and volumes
    resolve against."""

    def __init__(self, api: RealApi, reads: dict[tuple[str, str], Obj | None]):
        self.api, self.reads = api, reads

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        if plural not in POD_READS:
            raise KeyError(f"the kubelet does not read {plural} for a pod")
        return self.reads.get((plural, name))

    def bound_volume_path(self, claim: Obj) -> Path | None:
        volume_name = (claim.get("spec") or {}).get("volumeName")
        if not volume_name:
            raise MountError(f'persistentvolumeclaim "{meta(claim)["name"]}" is not bound')
        path = ((self.reads.get(("persistentvolumes", volume_name)) or {}).get("spec") or {}).get(
            "hostPath", {}).get("path")
        if not path:
            raise MountError(f'persistentvolume "{volume_name}" has no hostPath (yet)')
        return Path(path)

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None:
        return self.api.service_account_token(pod, request)


def pod_references(pod: Obj) -> set[tuple[str, str]]:
    """(plural, name) of every Secret, ConfigMap and claim a pod's volumes and containers name."""
    out: set[tuple[str, str]] = set()
    spec = pod.get("spec") or {}
    for vol in spec.get("volumes") or []:
        if "persistentVolumeClaim" in vol:
            out.add(("persistentvolumeclaims", vol["persistentVolumeClaim"]["claimName"]))
        sources = (vol["projected"].get("sources") or []) if "projected" in vol else [vol]
        for source in sources:
            if "secret" in source:
                out.add(("secrets", source["secret"].get("secretName") or source["secret"].get("name")))
            if "configMap" in source:
                out.add(("configmaps", source["configMap"]["name"]))
    for container in spec.get("containers") or []:
        for env in container.get("env") or []:
            ref = env.get("valueFrom") or {}
            if "secretKeyRef" in ref:
                out.add(("secrets", ref["secretKeyRef"]["name"]))
            if "configMapKeyRef" in ref:
                out.add(("configmaps", ref["configMapKeyRef"]["name"]))
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                out.add(("secrets", source["secretRef"]["name"]))
            if "configMapRef" in source:
                out.add(("configmaps", source["configMapRef"]["name"]))
    return out
