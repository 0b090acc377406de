"""The test cluster's clock (scaled durations) and its access to the emulator's API."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import kmock

from tests.support.kube_cluster.objects import FINALIZER, KIND_PLURALS, PLURALS, Obj, meta
from tests.support.kube_emulator import KubeEmulator


class Clock:
    """Kubernetes durations scaled for tests (package doc, rule 8)."""

    def __init__(self, scale: float, timeout_floor: float):
        self.scale, self.timeout_floor = scale, timeout_floor

    def seconds(self, k8s_seconds: float) -> float:
        return max(float(k8s_seconds), 0.0) * self.scale

    def timeout(self, k8s_seconds: float) -> float:
        return max(self.seconds(k8s_seconds), self.timeout_floor)


# ----------------------------------------------------------------------------------- API access


class PodApi(Protocol):
    """What the kubelet and its volume and env resolvers need of an API: `Api` (the emulator, in-process)
    and `real_api.RealApi` (a real apiserver, through a watch cache) both answer it."""

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]: ...

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None: ...

    async def patch(self, plural: str, namespace: str | None, name: str, body: Obj,
                    subresource: str | None = None) -> Obj | None: ...

    async def delete(self, plural: str, namespace: str | None, name: str) -> None: ...

    async def replace_status(self, plural: str, obj: Obj, status: Obj) -> None: ...

    async def hold_pod(self, pod: Obj) -> None: ...

    async def release_pod(self, pod: Obj) -> None: ...

    def bound_volume_path(self, claim: Obj) -> Path | None: ...

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None: ...


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

    # -- what the kubelet needs beyond reads and writes (real_api.RealApi answers the same on a real cluster)

    async def hold_pod(self, pod: Obj) -> None:
        """Keep a deleted pod Terminating until the kubelet has stopped it: here a finalizer, since the
        emulator deletes an object at once when nothing holds it."""
        finalizers = meta(pod).get("finalizers") or []
        if FINALIZER not in finalizers:
            await self.patch("pods", meta(pod).get("namespace"), meta(pod)["name"],
                             {"metadata": {"finalizers": [*finalizers, FINALIZER]}})

    async def release_pod(self, pod: Obj) -> None:
        """The pod's processes are gone: let the emulator finish deleting it (or, at shutdown, forget it)."""
        finalizers = meta(pod).get("finalizers") or []
        if FINALIZER in finalizers:
            rest = [f for f in finalizers if f != FINALIZER]
            await self.patch("pods", meta(pod).get("namespace"), meta(pod)["name"],
                             {"metadata": {"finalizers": rest or None}})

    def bound_volume_path(self, claim: Obj) -> Path | None:
        """The directory of the volume a claim is bound to; None here: the emulator has no PersistentVolumes
        (a claim's directory is made per claim, env.Volumes.claim_dir)."""
        return None

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None:
        """A projected `serviceAccountToken` source's token; None: the emulator issues none."""
        return None
