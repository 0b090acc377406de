"""The kubelet's API (`api.PodApi`) on a real apiserver: reads from watch caches, writes over HTTPS."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.kube_cluster.env import MountError
from tests.support.kube_cluster.objects import Obj, is_terminating, meta
from tests.support.kube_cluster.rest import MERGE_PATCH, RESOURCES, ApiError, Reflector, RestClient, path_of

WATCHED = ("pods", "services", "configmaps", "secrets", "persistentvolumeclaims", "persistentvolumes")
"""Everything a pod's containers, volumes and Services read: one watch each, cluster-wide (a test cluster
is small; a real kubelet would watch only what its pods name)."""
_IRREGULAR_PLURALS = {"StorageClass": "storageclasses", "EndpointSlice": "endpointslices"}


def plural_of(kind: str) -> str:
    plural = _IRREGULAR_PLURALS.get(kind, kind.lower() + "s")
    if plural not in RESOURCES:
        raise KeyError(f"kind {kind} is not one the process kubelet knows")
    return plural


class RealApi:
    """Reads are synchronous, from reflectors (what kubelet's informers give it); a write is seen by the
    next read only once its watch event has arrived, as for any controller."""

    def __init__(self, client: RestClient):
        self.client = client
        self.reflectors = {plural: Reflector(client, plural) for plural in WATCHED}
        self._tasks: list[asyncio.Task] = []
        self._tokens: dict[tuple[str, str], bytes | str] = {}  # (pod uid, audience) -> token, or why not
        self._token_tasks: dict[tuple[str, str], asyncio.Task] = {}

    async def start(self, timeout: float = 60.0) -> None:
        self._tasks = [asyncio.create_task(r.run(), name=f"reflector {p}") for p, r in self.reflectors.items()]
        await asyncio.wait_for(asyncio.gather(*(r.synced.wait() for r in self.reflectors.values())), timeout)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._token_tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks, *self._token_tasks.values(), return_exceptions=True)
        self._tasks = []

    def watch_errors(self) -> list[str]:
        return [e for r in self.reflectors.values() for e in r.errors]

    # -- reads (cached)

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return self.reflectors[plural].list(namespace)

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        return self.reflectors[plural].get(namespace if RESOURCES[plural][1] else None, name)

    # -- writes

    async def create(self, obj: Obj) -> Obj:
        plural = plural_of(obj["kind"])
        created = await self.client.request("POST", path_of(plural, meta(obj).get("namespace")), obj)
        assert created is not None
        return created

    async def patch(self, plural: str, namespace: str | None, name: str, body: Obj,
                    subresource: str | None = None) -> Obj | None:
        """A JSON merge patch (None deletes a key); None when the object is gone."""
        return await self.client.request("PATCH", path_of(plural, namespace, name, subresource), body,
                                         content_type=MERGE_PATCH)

    async def replace_status(self, plural: str, obj: Obj, status: Obj) -> None:
        """Write the kubelet's status fields through the status subresource. Keys it does not report stay
        as the apiserver has them (`qosClass` is computed at creation and immutable)."""
        status = {k: v for k, v in status.items() if k != "qosClass"}
        await self.patch(plural, meta(obj).get("namespace"), meta(obj)["name"], {"status": status}, "status")

    async def delete(self, plural: str, namespace: str | None, name: str, *, grace: int | None = None,
                     uid: str | None = None) -> None:
        """Delete (gracefully unless `grace`); a `uid` precondition spares a newer object of the same name."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self.client.request("DELETE", path_of(plural, namespace, name), body)
        except ApiError as exc:
            if exc.status != 409:  # 409: the uid changed, that pod is not ours to delete
                raise

    # -- the kubelet's part in a pod's life

    async def release_pod(self, pod: Obj) -> None:
        """A deleted pod's processes are gone: the final delete, grace 0, of exactly this pod (its uid)."""
        if is_terminating(pod):
            await self.delete("pods", meta(pod).get("namespace"), meta(pod)["name"], grace=0, uid=meta(pod)["uid"])

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
            answer = await self.client.request("POST", path_of("serviceaccounts", meta(pod)["namespace"], account,
                                                               "token"), body)
            self._tokens[key] = ((answer or {}).get("status") or {})["token"].encode()
        except (ApiError, OSError, KeyError) as exc:
            self._tokens[key] = repr(exc)
