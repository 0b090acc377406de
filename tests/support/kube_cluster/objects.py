"""Small helpers over Kubernetes objects (dicts) shared by the test cluster's parts."""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

Obj = dict[str, Any]


LOCAL_IP = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "0.0.0.0"})
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
TERMINATION_ENV = "ASYNCRL_TERMINATION_LOG"
CONTAINER_ENV = "KUBE_CLUSTER_CONTAINER"  # marks a container instance's processes (package doc, rule 6)
BACKOFF_INITIAL, BACKOFF_CAP = 10.0, 300.0


def rfc3339(when: float | None = None) -> str:
    moment = datetime.datetime.fromtimestamp(time.time() if when is None else when, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def is_terminating(obj: Obj) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def pod_ready(pod: Obj) -> bool:
    """Running and Ready, as controllers and the endpoints controller judge a pod."""
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in meta(obj).get("ownerReferences") or [])


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def template_hash(template: Obj) -> str:
    """A pod template's identity: pods whose hash differs from the owner's current one are out of date."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owner_reference(owner: Obj) -> Obj:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta(owner)["name"],
            "uid": meta(owner)["uid"], "controller": True, "blockOwnerDeletion": True}


def omit_zero(status: Obj, keys: Sequence[str]) -> Obj:
    """Drop zero values the API server never serialises (Go `omitempty`): readers must default them."""
    return {k: v for k, v in status.items() if not (k in keys and not v)}


def conditions(old: Sequence[Obj], new: Sequence[tuple[str, bool, str, str]]) -> list[Obj]:
    """Conditions (type, ok, reason, message) keeping `lastTransitionTime` while a status does not change."""
    before = {c.get("type"): c for c in old}
    out = []
    for kind, ok, reason, message in new:
        value = "True" if ok else "False"
        prev = before.get(kind) or {}
        cond: Obj = {"type": kind, "status": value,
                     "lastTransitionTime": prev["lastTransitionTime"] if prev.get("status") == value
                     and prev.get("lastTransitionTime") else rfc3339()}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        out.append(cond)
    return out
