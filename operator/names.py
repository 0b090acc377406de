"""Deterministic names and labels of a job's children (no generateName: retries must find them).

Kubernetes limits differ by kind: Services are DNS-1035 labels (63), a StatefulSet's name plus its
controller-revision hash must fit a 63-character label value (52), and a Deployment's pods add a
template hash and a random suffix (47 keeps pod names within 63). Long job names are truncated and
a short hash of the full job name keeps distinct jobs distinct.
"""

from __future__ import annotations

import hashlib

from asyncrl.api.spec import GROUP

MAX_NAME = 63
MAX_STATEFULSET = 52
MAX_DEPLOYMENT = 47
HASH_LEN = 6

LABEL_JOB = f"{GROUP}/job"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
OPERATOR_POD_LABELS = {LABEL_NAME: "asyncrl", LABEL_COMPONENT: "operator"}
"""Labels of the operator's own pod (charts/asyncrl/templates/deployment.yaml): jobs' NetworkPolicies admit it
(Redis, where it reads the trainer's outcome; the trainer's status port, which it mirrors)."""
MANAGED_BY = "asyncrl-operator"
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
"""Kueue's label: the LocalQueue of a workload (spec.queueName on the trainer and the rollout)."""
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue puts on a workload's pods until it admits them."""

ANNOTATION_DESIRED_HASH = f"{GROUP}/desired-hash"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
ANNOTATION_REDIS_AUTH_HASH = f"{GROUP}/redis-auth-hash"
"""Pod-template annotation: a salted hash of the live managed-Redis Secret. The apply layer fills it
in from the Secret it reads, so a re-created or rotated Secret rolls every pod that uses it."""
ANNOTATION_STATUS_AUTH_HASH = f"{GROUP}/status-auth-hash"
"""Trainer pod-template annotation: the same for the job's status-token Secret."""
ANNOTATION_ENGINE_AUTH_HASH = f"{GROUP}/engine-auth-hash"
"""Rollout and trainer pod-template annotation: the same for the job's engine API key Secret."""


def short_hash(text: str, length: int = HASH_LEN) -> str:
    """A stable lowercase hex digest prefix (not security relevant)."""
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def child_name(job: str, suffix: str, max_len: int = MAX_NAME) -> str:
    """`<job>-<suffix>`, or `<job prefix>-<hash>-<suffix>` when that would exceed `max_len`."""
    full = f"{job}-{suffix}"
    if len(full) <= max_len:
        return full
    keep = max_len - len(suffix) - HASH_LEN - 2
    if keep < 1:
        raise ValueError(f"suffix {suffix!r} leaves no room for the job name within {max_len} characters")
    prefix = job[:keep].rstrip("-")
    return f"{prefix}-{short_hash(job)}-{suffix}"


def config_map(job: str) -> str:
    return child_name(job, "config")


def redis(job: str) -> str:
    """The managed Redis StatefulSet and its Service share this name."""
    return child_name(job, "redis", MAX_STATEFULSET)


def redis_secret(job: str) -> str:
    return child_name(job, "redis-auth")


def status_secret(job: str) -> str:
    """The job's status-endpoint bearer token (key `token`): the trainer requires it, the mirror sends it."""
    return child_name(job, "status-auth")


def engine_secret(job: str) -> str:
    """The job's engine API key (key `api-key`): the engines require it, the workers and the trainer send it."""
    return child_name(job, "engine-auth")


def redis_network_policy(job: str) -> str:
    return child_name(job, "redis")


def rollout(job: str) -> str:
    return child_name(job, "rollout", MAX_DEPLOYMENT)


def reward(job: str) -> str:
    """The operator-run reward service (spec.reward.service.deployment): its Deployment, Service and
    NetworkPolicy share this name."""
    return child_name(job, "reward", MAX_DEPLOYMENT)


def trainer(job: str) -> str:
    """The trainer StatefulSet and its headless Service share this name."""
    return child_name(job, "trainer", MAX_STATEFULSET)


def status_service(job: str) -> str:
    return child_name(job, "status")


def shared_pvc(job: str) -> str:
    return child_name(job, "shared")


def job_labels(job: str) -> dict[str, str]:
    """Labels every child carries (selectors use the subset returned by `selector_labels`)."""
    return {
        LABEL_NAME: "asyncrl",
        LABEL_INSTANCE: job,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: "asyncrl",
        LABEL_JOB: job,
    }


def selector_labels(job: str, component: str) -> dict[str, str]:
    """The immutable selector of one component's pods."""
    return {LABEL_JOB: job, LABEL_COMPONENT: component}


def owned_selector() -> str:
    """Label selector of every child the operator manages (what its owned-kind watches ask for)."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_JOB}"


def selector_string(labels: dict[str, str]) -> str:
    """`k=v,k2=v2` for label selectors in URLs and in the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
