"""The children the operator's builders make of a job document (jobs come from tests.support.jobs)."""

from __future__ import annotations

import copy

from asyncrl.loader import parse_job
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
