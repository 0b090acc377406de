"""The test cluster's clock (scaled durations) and what its kubelet needs of an API."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tests.support.kube_cluster.objects import Obj


class Clock:
    """Kubernetes durations scaled for tests (package doc, rule 8)."""

    def __init__(self, scale: float, timeout_floor: float):
        self.scale, self.timeout_floor = scale, timeout_floor

    def seconds(self, k8s_seconds: float) -> float:
        return max(float(k8s_seconds), 0.0) * self.scale

    def timeout(self, k8s_seconds: float) -> float:
        return max(self.seconds(k8s_seconds), self.timeout_floor)


# ----------------------------------------------------------------------------------- API access


class ObjectReads(Protocol):
    """What a pod's env and volume resolvers read: the objects the pod names, as its kubelet sees them."""

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None: ...

    def bound_volume_path(self, claim: Obj) -> Path | None: ...

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None: ...

    async def fetch_for(self, pod: Obj) -> None: ...

    def reads_for(self, pod: Obj) -> ObjectReads: ...


class PodApi(Protocol):
    """What the kubelet and its volume and env resolvers need of an API (`real_api.RealApi` answers it:
    a real apiserver, through a watch cache)."""

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]: ...

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None: ...

    async def patch(self, plural: str, namespace: str | None, name: str, body: Obj,
                    subresource: str | None = None) -> Obj | None: ...

    async def delete(self, plural: str, namespace: str | None, name: str) -> None: ...

    async def replace_status(self, plural: str, obj: Obj, status: Obj) -> None: ...

    async def release_pod(self, pod: Obj) -> None: ...

    def bound_volume_path(self, claim: Obj) -> Path | None: ...

    def service_account_token(self, pod: Obj, request: Obj) -> bytes | None: ...

    async def fetch_for(self, pod: Obj) -> None: ...

    def reads_for(self, pod: Obj) -> ObjectReads: ...
