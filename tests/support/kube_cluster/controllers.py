"""The Deployment and StatefulSet controllers and the PVC binder."""

from __future__ import annotations

import copy
import math
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from tests.support.kube_cluster.api import Api
from tests.support.kube_cluster.objects import (
    Obj,
    conditions,
    is_terminating,
    meta,
    omit_zero,
    owned_by,
    owner_reference,
    pod_ready,
    rfc3339,
    template_hash,
)


def new_pod(owner: Obj, template: Obj, name: str, labels: Mapping[str, str], spec_extra: Obj | None = None) -> Obj:
    """A pod from an owner's template, owned by it (the garbage collector deletes it with its owner)."""
    tmeta = template.get("metadata") or {}
    pod_meta: Obj = {"name": name, "namespace": meta(owner).get("namespace") or "default",
                     "labels": {**(tmeta.get("labels") or {}), **labels},
                     "ownerReferences": [owner_reference(owner)]}
    if tmeta.get("annotations"):
        pod_meta["annotations"] = dict(tmeta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
            "spec": {**copy.deepcopy(template.get("spec") or {}), **(spec_extra or {})}}


def _int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


class DeploymentController:
    """Deployments -> pods (no ReplicaSet objects: the Deployment owns its pods; module doc)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, deployments: Sequence[Obj], pods: Sequence[Obj]) -> None:
        for deploy in deployments:
            if not is_terminating(deploy):
                owned = [p for p in pods if owned_by(p, meta(deploy)["uid"])]
                await self._sync_one(deploy, owned)

    async def _sync_one(self, deploy: Obj, pods: list[Obj]) -> None:
        spec = deploy.get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        current = template_hash(spec.get("template") or {})
        active = [p for p in pods if not is_terminating(p)]
        new = [p for p in active if (meta(p).get("labels") or {}).get("pod-template-hash") == current]
        old = [p for p in active if p not in new]
        strategy = spec.get("strategy") or {}
        rolling = strategy.get("rollingUpdate") or {}
        surge = _int_or_percent(rolling.get("maxSurge", "25%"), replicas, round_up=True)
        unavailable = _int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        doomed: list[Obj] = []
        create = 0
        if strategy.get("type") == "Recreate":
            doomed = old
            stale_left = any((meta(p).get("labels") or {}).get("pod-template-hash") != current for p in pods)
            create = 0 if stale_left else max(replicas - len(new), 0)
        else:
            create = max(min(replicas - len(new), replicas + surge - len(active)), 0)
            ready_total = sum(pod_ready(p) for p in active)
            for pod in sorted(old, key=self._deletion_order):
                if not pod_ready(pod):
                    doomed.append(pod)
                elif ready_total - 1 >= replicas - unavailable:
                    doomed.append(pod)
                    ready_total -= 1
        if len(new) > replicas:
            doomed += sorted(new, key=self._deletion_order)[: len(new) - replicas]
        for pod in doomed:
            await self.api.delete("pods", meta(pod)["namespace"], meta(pod)["name"])
        template = spec.get("template") or {}
        for _ in range(create):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            name = f"{meta(deploy)['name']}-{current}-{suffix}"
            await self.api.create(new_pod(deploy, template, name, {"pod-template-hash": current}))
        await self._write_status(deploy, replicas, new, active, unavailable, current)

    @staticmethod
    def _deletion_order(pod: Obj) -> tuple:
        """Unready pods first, then the newest (what a ReplicaSet deletes first)."""
        return (pod_ready(pod), [-ord(ch) for ch in meta(pod).get("creationTimestamp", "")])

    async def _write_status(self, deploy: Obj, replicas: int, new: list[Obj], active: list[Obj],
                            unavailable: int, current: str) -> None:
        ready = sum(pod_ready(p) for p in active)
        updated = len(new)
        old = deploy.get("status") or {}
        available_ok = ready >= replicas - unavailable
        complete = updated == replicas and len(active) == replicas and ready == replicas
        status = omit_zero({
            "observedGeneration": meta(deploy).get("generation", 1), "replicas": len(active),
            "updatedReplicas": updated, "readyReplicas": ready, "availableReplicas": ready,
            "unavailableReplicas": max(replicas - ready, 0),
            "conditions": conditions(old.get("conditions") or [], [
                ("Available", available_ok, "MinimumReplicasAvailable" if available_ok
                 else "MinimumReplicasUnavailable", "Deployment has minimum availability." if available_ok
                 else "Deployment does not have minimum availability."),
                ("Progressing", True, "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
                 f'ReplicaSet "{meta(deploy)["name"]}-{current}" '
                 f'{"has successfully progressed" if complete else "is progressing"}.')]),
        }, ["replicas", "updatedReplicas", "readyReplicas", "availableReplicas", "unavailableReplicas"])
        for cond in status["conditions"]:
            prev: Obj = next((c for c in old.get("conditions") or [] if c.get("type") == cond["type"]), {})
            same = prev.get("reason") == cond.get("reason") and prev.get("status") == cond["status"]
            cond["lastUpdateTime"] = prev.get("lastUpdateTime") if same and prev.get("lastUpdateTime") else rfc3339()
        await self.api.replace_status("deployments", deploy, status)


class StatefulSetController:
    """StatefulSets -> ordinal pods and their PVCs (package doc)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, sets: Sequence[Obj], pods: Sequence[Obj], claims: Sequence[Obj]) -> None:
        for sts in sets:
            if not is_terminating(sts):
                owned = [p for p in pods if owned_by(p, meta(sts)["uid"])]
                await self._sync_one(sts, owned, claims)

    @staticmethod
    def ordinal(sts: Obj, pod: Obj) -> int | None:
        prefix = meta(sts)["name"] + "-"
        name = meta(pod)["name"]
        tail = name[len(prefix):] if name.startswith(prefix) else ""
        return int(tail) if tail.isdigit() else None

    async def _sync_one(self, sts: Obj, owned: list[Obj], claims: Sequence[Obj]) -> None:
        spec = sts.get("spec") or {}
        name, namespace = meta(sts)["name"], meta(sts).get("namespace") or "default"
        replicas = int(spec.get("replicas", 1))
        revision = f"{name}-{template_hash(spec.get('template') or {})}"
        parallel = spec.get("podManagementPolicy") == "Parallel"
        pods = {i: p for p in owned if (i := self.ordinal(sts, p)) is not None}
        await self._sync_claims(sts, pods, replicas, claims)
        terminating = any(is_terminating(p) for p in pods.values())

        for i in range(replicas):  # create
            if i in pods:
                continue
            if not parallel and not all(j in pods and pod_ready(pods[j]) and not is_terminating(pods[j])
                                        for j in range(i)):
                break
            pods[i] = await self.api.create(self._pod(sts, i, revision))
            if not parallel:
                break
        condemned = sorted((i for i in pods if i >= replicas and not is_terminating(pods[i])), reverse=True)
        if condemned and (parallel or not terminating):  # scale down, highest ordinal first
            for i in condemned if parallel else condemned[:1]:
                await self.api.delete("pods", namespace, meta(pods[i])["name"])
        elif ((spec.get("updateStrategy") or {}).get("type", "RollingUpdate") == "RollingUpdate"
              and not terminating and all(i in pods for i in range(replicas))):
            partition = int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition", 0))
            for i in range(replicas - 1, partition - 1, -1):  # roll from the highest ordinal, one at a time
                if (meta(pods[i]).get("labels") or {}).get("controller-revision-hash") != revision:
                    await self.api.delete("pods", namespace, meta(pods[i])["name"])
                    break
                if not pod_ready(pods[i]):
                    break
        await self._write_status(sts, list(pods.values()), revision, replicas)

    def _pod(self, sts: Obj, ordinal: int, revision: str) -> Obj:
        spec = sts.get("spec") or {}
        name = f"{meta(sts)['name']}-{ordinal}"
        template = copy.deepcopy(spec.get("template") or {})
        volumes = [v for v in (template.get("spec") or {}).get("volumes") or []
                   if v["name"] not in {meta(t)["name"] for t in spec.get("volumeClaimTemplates") or []}]
        volumes += [{"name": meta(t)["name"], "persistentVolumeClaim":
                     {"claimName": f"{meta(t)['name']}-{name}"}} for t in spec.get("volumeClaimTemplates") or []]
        extra: Obj = {"hostname": name}
        if spec.get("serviceName"):
            extra["subdomain"] = spec["serviceName"]
        if volumes:
            extra["volumes"] = volumes
        labels = {"controller-revision-hash": revision, "statefulset.kubernetes.io/pod-name": name,
                  "apps.kubernetes.io/pod-index": str(ordinal)}
        return new_pod(sts, template, name, labels, extra)

    async def _sync_claims(self, sts: Obj, pods: Mapping[int, Obj], replicas: int, claims: Sequence[Obj]) -> None:
        """Create missing claims; apply the retention policy (ownerReferences, whenScaled deletion)."""
        spec = sts.get("spec") or {}
        namespace = meta(sts).get("namespace") or "default"
        policy = spec.get("persistentVolumeClaimRetentionPolicy") or {}
        owned = policy.get("whenDeleted") == "Delete"
        existing = {meta(c)["name"]: c for c in claims if (meta(c).get("namespace") or "default") == namespace}
        for template in spec.get("volumeClaimTemplates") or []:
            prefix = f"{meta(template)['name']}-{meta(sts)['name']}-"
            if policy.get("whenScaled") == "Delete":  # claims of removed ordinals, once their pod is gone
                for claim_name in existing:
                    tail = claim_name[len(prefix):] if claim_name.startswith(prefix) else ""
                    if tail.isdigit() and int(tail) >= replicas and int(tail) not in pods:
                        await self.api.delete("persistentvolumeclaims", namespace, claim_name)
            for i in range(replicas):
                claim_name = prefix + str(i)
                claim = existing.get(claim_name)
                if claim is None:
                    claim_meta: Obj = {"name": claim_name, "namespace": namespace,
                                       "labels": dict(meta(template).get("labels") or {})}
                    if owned:
                        claim_meta["ownerReferences"] = [{**owner_reference(sts), "controller": False}]
                    await self.api.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                           "metadata": claim_meta, "spec": copy.deepcopy(template.get("spec") or {})})
                elif owned != owned_by(claim, meta(sts)["uid"]):
                    refs = [r for r in meta(claim).get("ownerReferences") or [] if r.get("uid") != meta(sts)["uid"]]
                    refs += [{**owner_reference(sts), "controller": False}] if owned else []
                    await self.api.patch("persistentvolumeclaims", namespace, claim_name,
                                         {"metadata": {"ownerReferences": refs or None}})

    async def _write_status(self, sts: Obj, pods: list[Obj], revision: str, replicas: int) -> None:
        active = [p for p in pods if not is_terminating(p)]
        old = sts.get("status") or {}
        updated = sum((meta(p).get("labels") or {}).get("controller-revision-hash") == revision for p in active)
        current_rev = revision if updated == replicas else old.get("currentRevision", revision)
        current = sum((meta(p).get("labels") or {}).get("controller-revision-hash") == current_rev for p in active)
        ready = sum(pod_ready(p) for p in active)
        status = omit_zero({"observedGeneration": meta(sts).get("generation", 1), "replicas": len(active),
                            "readyReplicas": ready, "currentReplicas": current, "updatedReplicas": updated,
                            "availableReplicas": ready, "currentRevision": current_rev, "updateRevision": revision,
                            "collisionCount": 0},
                           ["readyReplicas", "currentReplicas", "updatedReplicas", "collisionCount"])
        await self.api.replace_status("statefulsets", sts, status)


class ClaimBinder:
    """Every PersistentVolumeClaim binds at once (a dynamic provisioner with an instant disk)."""

    def __init__(self, api: Api):
        self.api = api

    async def sync(self, claims: Sequence[Obj]) -> None:
        for claim in claims:
            spec = claim.get("spec") or {}
            status = {"phase": "Bound", "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                      "capacity": dict((spec.get("resources") or {}).get("requests") or {"storage": "1Gi"})}
            if (claim.get("status") or {}).get("phase") != "Bound":
                await self.api.replace_status("persistentvolumeclaims", claim, status)
