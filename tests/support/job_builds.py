"""The children the operator's builders make of a job document (jobs come from tests.support.jobs)."""

from __future__ import annotations

import copy

from asyncrl.api.loader import parse_job
from asyncrl.api.runtime import FILE_SUFFIX
from asyncrl.operator import builders as B
from asyncrl.operator import names as N

OPERATOR_NS = "ops"
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NS}},
                 "podSelector": {"matchLabels": N.OPERATOR_POD_LABELS}}
"""The operator's pod in its own namespace: never an empty namespaceSelector (any namespace)."""


def build(doc: dict, name: str | None = None, stopped: bool = False) -> list[dict]:
    doc = copy.deepcopy(doc)
    if name:
        doc["metadata"]["name"] = name
    job = parse_job(doc)
    return B.build_children(job, B.BuildContext(owner_uid="uid-1", namespace="ns", redis_password="pw",
                                                stopped=stopped or job.spec.suspend,
                                                operator_namespace=OPERATOR_NS))


def rollout_pod_containers(objs: list[dict]) -> dict[str, dict]:
    """The rollout pod's containers by name (engine, engine-proxy, worker) among built children."""
    deploy = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-rollout"))
    return {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}


def secret_files(pod: dict) -> dict[str, dict[str, tuple[str, str]]]:
    """container -> {variable: (Secret, key)}: every `<VAR>_FILE` resolved through the container's mounts
    to the Secret key behind the file (secret and projected volumes), as the kubelet would lay it out."""
    behind: dict[tuple[str, str], tuple[str, str]] = {}
    for vol in pod.get("volumes", []):
        for src in vol["projected"]["sources"] if "projected" in vol else [vol]:
            if "secret" in src:
                ref = src["secret"]
                for item in ref["items"]:
                    behind[(vol["name"], item["path"])] = (ref["name"] if "projected" in vol else ref["secretName"],
                                                           item["key"])
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for c in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        found = {}
        for e in c.get("env", []):
            if e["name"].endswith(FILE_SUFFIX):
                folder, _, file = e["value"].rpartition("/")
                found[e["name"].removesuffix(FILE_SUFFIX)] = behind[(mounts[folder], file)]
        out[c["name"]] = found
    return out


def secret_env(container: dict) -> list[str]:
    """The container's variables set from a Secret (what should be files)."""
    return [e["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
