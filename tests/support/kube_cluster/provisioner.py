"""A hostPath volume provisioner for the process kubelet: a directory per PersistentVolumeClaim.

It plays an external provisioner's part only: a PersistentVolume pre-bound (`claimRef`) to each claim
that has none, and deleting Released volumes it made. The real PV controller binds the pair and the
real scheduler waits for the binding, as on a cluster with dynamic provisioning.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.kube_cluster.objects import Obj, is_terminating, meta
from tests.support.kube_cluster.real_api import RealApi
from tests.support.kube_cluster.rest import ApiError

STORAGE_CLASS = "process-local"
PROVISIONER = "kube-cluster.asyncrl.test/process-local"
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"


class HostPathProvisioner:
    """Provisions every pending claim (any class) with a directory under `root`."""

    def __init__(self, api: RealApi, root: Path):
        self.api, self.root = api, Path(root)
        self.requested: set[str] = set()  # claim uids a volume was created for

    async def start(self) -> None:
        """The default StorageClass (so a claim without a class gets one, as on a managed cluster)."""
        try:
            await self.api.create({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                                   "metadata": {"name": STORAGE_CLASS, "annotations": {DEFAULT_CLASS: "true"}},
                                   "provisioner": PROVISIONER, "reclaimPolicy": "Delete",
                                   "volumeBindingMode": "Immediate"})
        except ApiError as exc:
            if exc.status != 409:  # another cluster of this session made it
                raise

    async def sync(self) -> None:
        for claim in self.api.list("persistentvolumeclaims"):
            uid = meta(claim)["uid"]
            if (claim.get("spec") or {}).get("volumeName") or is_terminating(claim) or uid in self.requested:
                continue
            try:
                await self.api.create(self._volume(claim))
            except ApiError as exc:
                if exc.status != 409:  # 409: made already (by an earlier cluster of the session), binding
                    raise
            self.requested.add(uid)
        for volume in self.api.list("persistentvolumes"):
            if ((meta(volume).get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER
                    and (volume.get("status") or {}).get("phase") == "Released" and not is_terminating(volume)):
                await self.api.delete("persistentvolumes", None, meta(volume)["name"])
                shutil.rmtree((volume.get("spec") or {}).get("hostPath", {}).get("path", ""), ignore_errors=True)

    def _volume(self, claim: Obj) -> Obj:
        spec = claim.get("spec") or {}
        namespace, name, uid = meta(claim)["namespace"], meta(claim)["name"], meta(claim)["uid"]
        path = self.root / namespace / f"{name}-{uid[:8]}"
        path.mkdir(parents=True, exist_ok=True)
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        return {"apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": f"pvc-{uid}", "annotations": {PROVISIONED_BY: PROVISIONER}},
                "spec": {"capacity": {"storage": storage},
                         "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                         "volumeMode": spec.get("volumeMode") or "Filesystem",
                         "storageClassName": spec.get("storageClassName") or "",
                         "persistentVolumeReclaimPolicy": "Delete",
                         "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                         "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace,
                                      "name": name, "uid": uid}}}
