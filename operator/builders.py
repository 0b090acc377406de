"""Pure desired-state builders: a validated AsyncRLJob in, the Kubernetes objects it needs out.

No I/O and no clock here, so `asyncrl render`, the operator and the golden tests all see exactly the
same objects. Every child is named by asyncrl.operator.names, carries the job's labels and a
controller ownerReference to the job (except the shared weights volume, unless
`spec.storage.deleteWithJob`: it outlives the job), and runs as non-root under the `restricted` Pod
Security profile. The apply layer (asyncrl.operator.kube) decides create vs. patch; this module only says
what should exist.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import yaml

from asyncrl.api import runtime as R
from asyncrl.api.engine_servers import (
    ENGINE_KEY_DIR,
    ENGINE_KEY_VOLUME,
    PROXY_LIVE_PATH,
    PROXY_READY_PATH,
    VLLM_SERVER_ENV,
    engine_proxy_command,
    vllm_server_command,
)
from asyncrl.api.spec import API_VERSION, KIND, AsyncRLJob, Resources, RewardDeploymentSpec
from asyncrl.api.spec.base import SpecModel, parse_quantity
from asyncrl.api.spec.lora import VLLM_LORA_ENV, sglang_lora_args, vllm_lora_args
from asyncrl.api.spec.pod_template import PodTemplateOverlay
from asyncrl.operator import multinode as MN
from asyncrl.operator import names as N
from asyncrl.operator.config import DEFAULT_OPERATOR_NAMESPACE, DEFAULT_ROLLOUT_IMAGE, DEFAULT_TRAINER_IMAGE

Obj = dict[str, Any]

CONFIG_DIR = "/etc/asyncrl"
CONFIG_FILE = f"{CONFIG_DIR}/job.yaml"
SHARED_DIR = "/shared"
ENGINE_PORT = 30000
"""The rollout pod's engine port: the engine proxy's, where every route needs the engine API key."""
ENGINE_LOCAL_PORT = 30001
"""Where the engine itself listens, on the pod's loopback and without a key (the proxy's upstream)."""
ENGINE_PROXY_CONTAINER = "engine-proxy"
RDZV_PORT = 29500
WEIGHT_GROUP_PORT = R.DEFAULT_WEIGHT_GROUP_PORT
"""With trainer.weightTransport collective: the weight group's TCPStore on trainer rank 0."""
REDIS_PORT = 6379
GPU_RESOURCE = "nvidia.com/gpu"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the apiserver on every namespace (immutable): a NetworkPolicy names a namespace by it."""
RUN_AS_USER = 1000
REDIS_UID = 999  # the `redis` user of the official redis images

# Spec fields whose change needs no pod restart (scaling and lifecycle knobs).
_LIVE_FIELDS = (("rollout", "replicas"), ("trainer", "replicas"), ("suspend",),
                ("startupDeadlineSeconds",), ("ttlSecondsAfterFinished",), ("storage", "deleteWithJob"),
                ("trainer", "backoffLimit"), ("activeDeadlineSeconds",))


@dataclass(frozen=True)
class BuildContext:
    """What the builders need that the spec does not say; everything else they read from the job.

    It exists because these come from elsewhere: the live object (its uid, the namespace it was
    created in; `asyncrl render` makes up stand-ins), the operator's configuration (images for
    jobs whose spec names none), a fresh secret, and the job's status (finished jobs stop too).
    """

    owner_uid: str
    namespace: str
    redis_password: str = ""
    """Only used to fill the managed-Redis Secret when it is first created (never patched)."""
    status_token: str = ""
    """Only used to fill the status-token Secret when it is first created (never patched)."""
    engine_api_key: str = ""
    """Only used to fill the engine API key Secret when it is first created (never patched)."""
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    """Used when spec.trainer.image is unset."""
    rollout_image: str = DEFAULT_ROLLOUT_IMAGE
    """Used when spec.rollout.workerImage is unset (and as the `hf` engine's image)."""
    stopped: bool = False
    """Scale rollout and trainer to zero: the spec suspends the job, or it has finished."""
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    """The namespace the operator runs in: the jobs' NetworkPolicies admit its pod from there only."""


# ----------------------------------------------------------------------------------- helpers


def stable_hash(obj: Any) -> str:
    """Hash of a JSON-able value, independent of key order."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def owner_reference(job: AsyncRLJob, uid: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.metadata.name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: AsyncRLJob, ctx: BuildContext, name: str, component: str) -> Obj:
    labels = {**N.job_labels(job.metadata.name), N.LABEL_COMPONENT: component}
    return {"name": name, "namespace": ctx.namespace, "labels": labels,
            "ownerReferences": [owner_reference(job, ctx.owner_uid)]}


def _queued(job: AsyncRLJob, obj: Obj) -> Obj:
    """A trainer or rollout workload with spec.queueName's Kueue label on it and on its pods (Kueue's
    StatefulSet and Deployment integrations read it from the object; the pods carry it too)."""
    queue = job.spec.queue_name
    if queue is None:
        return obj
    out = copy.deepcopy(obj)
    for meta in (out["metadata"], out["spec"]["template"]["metadata"]):
        meta["labels"] = {**meta["labels"], N.LABEL_KUEUE_QUEUE: queue}
    return out


def _resources(res: Resources, gpus: int = 0) -> Obj:
    requests: dict[str, str] = {}
    limits: dict[str, Any] = {}
    if res.cpu:
        requests["cpu"] = limits["cpu"] = res.cpu
    if res.memory:
        requests["memory"] = limits["memory"] = res.memory
    if res.ephemeral_storage:
        requests["ephemeral-storage"] = res.ephemeral_storage
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _redis_memory_args(res: Resources) -> list[str]:
    """maxmemory at 90% of the container's memory limit (room for the AOF rewrite's fork and the
    allocator's overhead), noeviction: a full Redis answers writes with an OOM error instead of
    dropping keys, and the kernel never has to kill it. No limit: no maxmemory."""
    if not res.memory:
        return []
    return ["--maxmemory", str(int(parse_quantity(res.memory) * 9 // 10)), "--maxmemory-policy", "noeviction"]


def _container_security(read_only_root: bool) -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": read_only_root, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_security(uid: int) -> Obj:
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def secret_hash(secret: Obj) -> str:
    """Hash of a Secret's content, salted with its uid: what pod templates carry to roll on a new Secret.

    Reads `data` (base64, as the API server returns it) and `stringData` (as written, and as the
    builders render it), like the API server merges them. The salt keeps a weak hand-set password
    from being guessed offline by someone who may read Deployments but not Secrets; a re-created
    Secret (new uid) gets a new hash even with the same password.
    """
    content: dict[str, str] = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            content[key] = base64.b64decode(value or "", validate=True).decode("utf-8", errors="replace")
        except (binascii.Error, ValueError):
            content[key] = str(value)
    content.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    return stable_hash({"uid": (secret.get("metadata") or {}).get("uid", ""), "data": content})


def _template_annotations(job: AsyncRLJob, ctx: BuildContext, *, config: bool = True,
                          status_token: bool = False, engine_key: bool = True) -> Obj:
    """Pod-template annotations whose change rolls the pods: the config hash and the hashes of the
    Secrets the pods read (Redis's; the engine API key's with `engine_key`, the rollout and the trainer;
    the status token's with `status_token`, the trainer alone).

    The Secret hash rendered here is that of the Secret these builders render (so `asyncrl render`
    is self-consistent); the operator's apply layer replaces it with the hash of the live Secret.
    """
    out: Obj = {N.ANNOTATION_CONFIG_HASH: config_hash(job)} if config else {}
    if job.spec.redis.mode == "managed":
        out[N.ANNOTATION_REDIS_AUTH_HASH] = secret_hash(redis_secret(job, ctx))
    if status_token:
        out[N.ANNOTATION_STATUS_AUTH_HASH] = secret_hash(status_secret(job, ctx))
    if engine_key:
        out[N.ANNOTATION_ENGINE_AUTH_HASH] = secret_hash(engine_secret(job, ctx))
    return out


JOB_SECRETS_VOLUME = "job-secrets"
_SECRET_FILES = {R.ENV_REDIS_URL: "redis-url", R.ENV_ENGINE_API_KEY: "engine-api-key",
                 R.ENV_STATUS_TOKEN: "status-token", R.ENV_REWARD_API_KEY: "engine-api-key"}
"""The file (under R.SECRETS_DIR) of each secret variable; the reward service's key is the engine's."""


def _secret_file_env(var: str) -> Obj:
    """`<var>_FILE`: where the process finds the secret (asyncrl.api.runtime.secret_env), never its value."""
    return {"name": var + R.FILE_SUFFIX, "value": f"{R.SECRETS_DIR}/{_SECRET_FILES[var]}"}


def _job_secrets_volume(job: AsyncRLJob, *, status_token: bool) -> Obj:
    """The job's Secrets as files for the trainer (with the status token) or the rollout worker: the Redis
    URL (the managed Redis Secret's, or the external one's), the engine API key, and the status token."""
    name, r = job.metadata.name, job.spec.redis
    redis = ((r.external.url_secret.name, r.external.url_secret.key) if r.mode == "external" and r.external
             else (N.redis_secret(name), "url"))
    refs = [(*redis, R.ENV_REDIS_URL), (N.engine_secret(name), "api-key", R.ENV_ENGINE_API_KEY)]
    if status_token:
        refs.append((N.status_secret(name), "token", R.ENV_STATUS_TOKEN))
    sources = [{"secret": {"name": secret, "items": [{"key": key, "path": _SECRET_FILES[var]}]}}
               for secret, key, var in refs]
    # 0440 with the pod's fsGroup: the container's user reads them, nobody else
    return {"name": JOB_SECRETS_VOLUME, "projected": {"sources": sources, "defaultMode": 0o440}}


_JOB_SECRETS_MOUNT = {"name": JOB_SECRETS_VOLUME, "mountPath": R.SECRETS_DIR, "readOnly": True}


def _secret_file_volume(volume: str, secret: str, key: str) -> Obj:
    """One key of a Secret as the file `key` of a volume, readable by the pod's group (fsGroup) and
    nobody else: how the engine proxy and Redis get their secret, never as a variable."""
    return {"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": key}],
                                       "defaultMode": 0o440}}


def _common_env(job: AsyncRLJob, ctx: BuildContext) -> list[Obj]:
    """The asyncrl.api.runtime variables every rollout worker and trainer process reads; secrets as files
    (the container mounts _JOB_SECRETS_MOUNT)."""
    return [
        _secret_file_env(R.ENV_REDIS_URL),
        # In every Redis key: a job re-created with the same name never reads the old run's streams.
        {"name": R.ENV_JOB_UID, "value": ctx.owner_uid},
        {"name": R.ENV_WEIGHTS_DIR, "value": f"{SHARED_DIR}/weights"},
        {"name": R.ENV_CHECKPOINT_DIR, "value": f"{SHARED_DIR}/checkpoints"},
        {"name": R.ENV_RUN_DIR, "value": f"{SHARED_DIR}/runs"},
        {"name": R.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{SHARED_DIR}/hf-cache"},
        _secret_file_env(R.ENV_ENGINE_API_KEY),
    ]


def _tracker_env(job: AsyncRLJob) -> tuple[list[Obj], list[Obj]]:
    """The trainer's experiment-tracker credentials from the job's Secrets, as (env, envFrom):
    WANDB_API_KEY from spec.logging.wandb.apiKeySecret, and every key of
    spec.logging.mlflow.credentialsSecret (MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN). A missing
    Secret keeps the pod from starting (CreateContainerConfigError) rather than training untracked."""
    lg = job.spec.logging
    env: list[Obj] = []
    env_from: list[Obj] = []
    if lg.wandb is not None and lg.wandb.api_key_secret is not None:
        ref = lg.wandb.api_key_secret
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if lg.mlflow is not None and lg.mlflow.credentials_secret is not None:
        env_from.append({"secretRef": {"name": lg.mlflow.credentials_secret}})
    return env, env_from


def _shared_claim(job: AsyncRLJob) -> str:
    return job.spec.storage.claim_name or N.shared_pvc(job.metadata.name)


def _pod_volumes(job: AsyncRLJob) -> list[Obj]:
    return [
        {"name": "config", "configMap": {"name": N.config_map(job.metadata.name)}},
        {"name": "shared", "persistentVolumeClaim": {"claimName": _shared_claim(job)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


# Pod-spec fields the builders never set: an overlay's value is used as given.
_OVERLAY_POD_FIELDS = ("node_selector", "tolerations", "affinity", "priority_class_name", "scheduler_name",
                       "service_account_name", "image_pull_secrets")


def _wire(value: Any) -> Any:
    """An overlay value as it appears in a manifest (camelCase, unset fields left out)."""
    if isinstance(value, list):
        return [_wire(v) for v in value]
    if isinstance(value, SpecModel):
        return value.to_wire()
    return copy.deepcopy(value)


def apply_pod_template(template: Obj, overlay: PodTemplateOverlay | None) -> Obj:
    """A pod template with a role's `podTemplate` overlay merged in (a new dict; `template` is unchanged).

    Precedence, the operator first (docs/operator.md, "Pod templates"):
    - operator-owned fields (containers' command, args, image, ports, probes, resources, security
      contexts; the pod's securityContext, automountServiceAccountToken, terminationGracePeriodSeconds)
      are not in the overlay at all;
    - labels and annotations are added after the pod's; a key the operator sets wins (the spec already
      rejects its keys and the `asyncrl.dev/` prefix, so this only guards objects built unvalidated);
    - nodeSelector, tolerations, affinity, priorityClassName, schedulerName, serviceAccountName and
      imagePullSecrets are fields the builders never set: the overlay's value is used as given;
    - env is appended to every container after the operator's variables; a name the container already
      has is skipped (the spec rejects it), so user env may reference operator env as `$(NAME)`;
    - envFrom is added to every container; Kubernetes gives `env` precedence over `envFrom`, so a
      ConfigMap or Secret key cannot shadow an operator variable either;
    - volumes are appended after the operator's and volumeMounts to every container; a volume name or
      mountPath the operator already uses is skipped (the spec rejects both);
    - "every container" is every one but the engine proxy, which guards the engine and takes nothing
      from the user.
    With no overlay the template is returned as is, so jobs without one render exactly as before.
    """
    if overlay is None:
        return template
    out = copy.deepcopy(template)
    meta = out.setdefault("metadata", {})
    for key, extra in (("labels", overlay.labels), ("annotations", overlay.annotations)):
        if extra:
            own = meta.get(key, {})
            meta[key] = {**own, **{k: v for k, v in extra.items() if k not in own}}
    pod = out["spec"]
    for field in _OVERLAY_POD_FIELDS:
        value = getattr(overlay, field)
        wire = type(overlay).model_fields[field].alias or field
        if value is not None and wire not in pod:
            pod[wire] = _wire(value)
    if overlay.volumes:
        taken = {v["name"] for v in pod.get("volumes", [])}
        pod["volumes"] = [*pod.get("volumes", []), *(_wire(v) for v in overlay.volumes if v.name not in taken)]
    for container in pod["containers"]:
        if container["name"] == ENGINE_PROXY_CONTAINER:
            continue
        if overlay.env:
            have = {e["name"] for e in container.get("env", [])}
            container["env"] = [*container.get("env", []), *(_wire(e) for e in overlay.env if e.name not in have)]
        if overlay.env_from:
            container["envFrom"] = [*container.get("envFrom", []), *_wire(overlay.env_from)]
        if overlay.volume_mounts:
            used = {m["mountPath"] for m in container.get("volumeMounts", [])}
            container["volumeMounts"] = [*container.get("volumeMounts", []),
                                         *(_wire(m) for m in overlay.volume_mounts if m.mount_path not in used)]
    return out


_MOUNTS = [
    {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    {"name": "shared", "mountPath": SHARED_DIR},
    {"name": "tmp", "mountPath": "/tmp"},
]
_DSHM = {"name": "dshm", "mountPath": "/dev/shm"}


def job_document(job: AsyncRLJob) -> Obj:
    """The job file the pods read: the validated spec with every default filled in."""
    meta: Obj = {"name": job.metadata.name}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": job.spec.to_wire()}


def config_hash(job: AsyncRLJob) -> str:
    """Hash of the spec minus the live fields: pods restart when (and only when) it changes.

    Fields at their defaults are left out, so an operator upgrade that adds a spec field (at a
    default that keeps the old behaviour) does not restart every running job's pods; the flip side,
    an upgrade that changes a default restarts nothing either (running pods keep the old value
    until they restart), so a changed default is called out in the release notes."""
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True, mode="json")
    for node in (spec, spec.get("evaluation", {})):  # (a default dataset is filled in by validation,
        if node.get("dataset") == {}:                # not a field default: left out as one would be)
            del node["dataset"]
    for path in _LIVE_FIELDS:
        node = spec
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    return stable_hash(spec)


# ----------------------------------------------------------------------------------- objects


def config_map(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    text = yaml.safe_dump(job_document(job), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, ctx, N.config_map(job.metadata.name), "config"),
            "data": {"job.yaml": text}}


def redis_secret(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    host = f"{N.redis(name)}.{ctx.namespace}.svc"
    password = ctx.redis_password
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(job, ctx, N.redis_secret(name), "redis"),
            "stringData": {"password": password, "url": f"redis://:{password}@{host}:{REDIS_PORT}/0"}}


def status_secret(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The bearer token of the trainer's status endpoint: the trainer requires it on every route but
    /healthz (ASYNCRL_STATUS_TOKEN), the operator's mirror sends it. Created once with a random token
    (create-only, like the Redis Secret) and owned by the job; a rotated token rolls the trainer."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(job, ctx, N.status_secret(job.metadata.name), "status"),
            "stringData": {"token": ctx.status_token}}


def engine_secret(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The engines' API key: each rollout pod's engine proxy refuses every request without it (the
    engine behind it never sees it); the workers and the trainer send it. Created once with a random
    key (create-only, like the Redis Secret) and owned by the job; a rotated key rolls the rollout pods
    and the trainer."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(job, ctx, N.engine_secret(job.metadata.name), "rollout"),
            "stringData": {"api-key": ctx.engine_api_key}}


def redis_service(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, ctx, N.redis(name), "redis"),
            "spec": {"selector": N.selector_labels(name, "redis"),
                     "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}}


REDIS_CONF_VOLUME = "redis-conf"
"""The managed Redis pod's in-memory volume for its generated config file (a reserved overlay name)."""
REDIS_CONF_DIR = "/run/redis"
REDIS_CONF = f"{REDIS_CONF_DIR}/auth.conf"
REDIS_AUTH_VOLUME = "redis-auth"
REDIS_AUTH_DIR = "/var/run/secrets/asyncrl/redis"
"""The Redis Secret's password as a file, in the Redis container alone: no environment variable."""
REDIS_PASSWORD_FILE = f"{REDIS_AUTH_DIR}/password"
# `$(cat FILE)` puts only the path on cat's argv, `printf` is a shell builtin (no child process), and
# the variable is not exported: the password is on no argv and in no environment. umask 077: the
# file is the redis user's alone; `exec`: redis-server replaces the shell and gets the pod's SIGTERM.
# The value is written unquoted, as Redis reads a config line: fine for the operator's hex passwords
# (a hand-set one with whitespace or quotes would make Redis refuse to start, not run open).
REDIS_AUTH_SCRIPT = (f'umask 077 && secret=$(cat {REDIS_PASSWORD_FILE}) && printf "requirepass %s\\n" "$secret" > '
                     f'{REDIS_CONF} && unset secret && exec redis-server {REDIS_CONF} "$@"')
REDIS_PING_SCRIPT = f'REDISCLI_AUTH=$(cat {REDIS_PASSWORD_FILE}) && export REDISCLI_AUTH && exec redis-cli "$@"'
"""The readiness probe: redis-cli takes the password from REDISCLI_AUTH, set in its own process only."""


def redis_statefulset(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    m = job.spec.redis.managed
    # appendfsync always: a write is on disk before Redis replies. With everysec a plain kill of the
    # Redis process lost acknowledged publishes and acks (36 of 1440 groups in 240 kill rounds);
    # a lost ack re-surfaces a trained entry and a lost trained mark lets it be trained twice.
    # always lost nothing in 180 rounds and still moved 474-728 groups/s of 100 KB.
    persistence = (["--appendonly", "yes", "--appendfsync", "always"] if m.append_only
                   else ["--appendonly", "no", "--save", ""])
    selector = N.selector_labels(name, "redis")
    claim: Obj = {"metadata": {"name": "data", "labels": {**N.job_labels(name), N.LABEL_COMPONENT: "redis"}},
                  "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": m.storage}}}}
    if m.storage_class_name:
        claim["spec"]["storageClassName"] = m.storage_class_name
    container = {
        "name": "redis",
        "image": m.image,
        # The password reaches redis-server through a config file, never its argv (which `ps` and the
        # pod spec would show) or environment: REDIS_AUTH_SCRIPT reads it from the mounted Secret into
        # REDIS_CONF and execs the server with these args ("$@"; sh's $0 names the process).
        "command": ["sh", "-c", REDIS_AUTH_SCRIPT, "redis-server"],
        "args": ["--port", str(REDIS_PORT), "--dir", "/data", *persistence, *_redis_memory_args(m.resources)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"exec": {"command": ["sh", "-c", REDIS_PING_SCRIPT, "redis-cli", "-p", str(REDIS_PORT),
                                                "ping"]}, "periodSeconds": 5,
                           "timeoutSeconds": 3},
        # the port named, not implied: the probe then says which port it checks
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 15, "failureThreshold": 4},
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": REDIS_CONF_VOLUME, "mountPath": REDIS_CONF_DIR},
                         {"name": REDIS_AUTH_VOLUME, "mountPath": REDIS_AUTH_DIR, "readOnly": True}],
        "securityContext": _container_security(read_only_root=True),
    }
    resources = _resources(m.resources)
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(job, ctx, N.redis(name), "redis"),
        "spec": {
            "replicas": 1,
            "serviceName": N.redis(name),
            "selector": {"matchLabels": selector},
            "template": apply_pod_template({
                "metadata": {"labels": {**N.job_labels(name), **selector},
                             "annotations": _template_annotations(job, ctx, config=False, engine_key=False)},
                "spec": {"securityContext": _pod_security(REDIS_UID), "automountServiceAccountToken": False,
                         "containers": [container],
                         # in memory: the password file never reaches a node's disk
                         "volumes": [{"name": REDIS_CONF_VOLUME,
                                      "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                                     _secret_file_volume(REDIS_AUTH_VOLUME, N.redis_secret(name), "password")]},
            }, m.pod_template),
            "volumeClaimTemplates": [claim],
            # The AOF volume belongs to this run: it goes when the StatefulSet does (which the job
            # owns), so a new job of the same name starts empty; scaling down keeps it.
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
        },
    }


def _from_job(name: str) -> Obj:
    """A NetworkPolicy peer: the job's own pods (any component), in the job's namespace."""
    return {"podSelector": {"matchLabels": {N.LABEL_JOB: name}}}


def _from_operator(ctx: BuildContext) -> Obj:
    """A NetworkPolicy peer: the operator's pod (its labels: charts/asyncrl/templates/deployment.yaml,
    checked by tests/packaging/test_helm_chart.py) in the operator's namespace only. The namespace is named by
    the label the apiserver sets on every namespace (kubernetes.io/metadata.name): an empty selector
    would admit any pod anywhere that carries those two labels."""
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ctx.operator_namespace}},
            "podSelector": {"matchLabels": dict(N.OPERATOR_POD_LABELS)}}


def _tcp(*ports: int) -> list[Obj]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _from_component(name: str, component: str) -> Obj:
    """A NetworkPolicy peer: one component's pods of the job, in the job's namespace."""
    return {"podSelector": {"matchLabels": N.selector_labels(name, component)}}


def _collective(job: AsyncRLJob) -> bool:
    """trainer.weightTransport collective: trainer rank 0 and every engine form one process group."""
    return job.spec.trainer.weight_transport == "collective"


def redis_network_policy(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Only the job's own pods, and the operator (which reads the trainer's outcome record there),
    reach the managed Redis."""
    name = job.metadata.name
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, ctx, N.redis_network_policy(name), "redis"),
            "spec": {"podSelector": {"matchLabels": N.selector_labels(name, "redis")},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [_from_job(name), _from_operator(ctx)], "ports": _tcp(REDIS_PORT)}]}}


def rollout_network_policy(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Only the job's own pods reach the rollout pods' engine port.

    Behind the port, the engine proxy asks every request for the engine API key; this policy is the
    second fence, where the CNI enforces it: nothing outside the job reaches the engines' admin API
    (pause, weight loads) even with a leaked key. The trainer calls it (pause, update, resume) at each
    pod's IP; the worker beside the engine uses 127.0.0.1, which no policy filters. Selecting the pods
    denies every other port too; the kubelet's probes come from the node, which Kubernetes always admits.

    With trainer.weightTransport collective the engines are ranks of the trainer's weight group: NCCL
    (and Gloo, for hf) connect rank to rank on ephemeral ports in both directions, the trainer's rank 0
    to the engines and the engines to each other (bootstrap ring, broadcast ring or tree, Gloo's full
    mesh), so every port is open from the job's trainer and rollout pods; disk transport adds nothing.
    """
    name = job.metadata.name
    ingress: list[Obj] = [{"from": [_from_job(name)], "ports": _tcp(ENGINE_PORT)}]
    if _collective(job):
        ingress.append({"from": [_from_component(name, "trainer"), _from_component(name, "rollout")]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, ctx, N.rollout(name), "rollout"),
            "spec": {"podSelector": {"matchLabels": N.selector_labels(name, "rollout")},
                     "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def trainer_network_policy(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Only the job's own pods reach the trainer's c10d rendezvous and status ports, and only the
    operator besides them, on the status port (asyncrl.operator.mirror.fetch_report reads /status).

    Between the trainer's own pods every port is open: after the rendezvous on the c10d port, NCCL and
    Gloo connect rank to rank on ephemeral ports, so a port list would break multi-node training.
    Nothing else may connect: torchrun's rendezvous store takes no credentials (the status endpoint
    also requires the job's bearer token, `status_secret`). A Prometheus that scrapes the trainer's
    /metrics (on the status port) needs a NetworkPolicy of its own that admits it (and the token):
    policies add up, none can take away.
    Egress is not restricted (policyTypes: Ingress only): the trainer reaches the experiment trackers'
    servers (W&B, an MLflow tracking server) and model hubs; a namespace whose default policy denies
    egress must allow those itself.
    With trainer.weightTransport collective the job's rollout pods are admitted on every port too: the
    engines dial the weight group's store (WEIGHT_GROUP_PORT) and then NCCL/Gloo connect on ephemeral ports.
    """
    name = job.metadata.name
    status = job.spec.trainer.status_port
    ingress: list[Obj] = [{"from": [_from_component(name, "trainer")]},
                          {"from": [_from_job(name)], "ports": _tcp(RDZV_PORT, status)},
                          {"from": [_from_operator(ctx)], "ports": _tcp(status)}]
    if _collective(job):
        ingress.append({"from": [_from_component(name, "rollout")]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, ctx, N.trainer(name), "trainer"),
            "spec": {"podSelector": {"matchLabels": N.selector_labels(name, "trainer")},
                     "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def shared_pvc(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    s = job.spec.storage
    spec: Obj = {"accessModes": [s.access_mode], "resources": {"requests": {"storage": s.size}}}
    if s.storage_class_name:
        spec["storageClassName"] = s.storage_class_name
    meta = _meta(job, ctx, N.shared_pvc(job.metadata.name), "storage")
    if not s.delete_with_job:
        # Not owned: the final weights outlive the job and its ttlSecondsAfterFinished.
        del meta["ownerReferences"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def engine_container(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The inference server of a rollout pod (SGLang, vLLM, or our in-process transformers server).

    It listens on the pod's loopback and gets no API key: the pinned engines' own key leaves routes
    open (vLLM) or lands in a log and argv (SGLang), so engine_proxy_container is the pod's engine port.
    """
    ro, model = job.spec.rollout, job.spec.model
    tp = str(max(ro.gpus_per_replica, 1))
    port = str(ENGINE_LOCAL_PORT)
    env: list[Obj] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": f"{SHARED_DIR}/hf-cache"}]
    # SGLang's (and our hf server's) GET /health then answers without generating a token: the proxy's
    # readiness reads it, and it must not wait behind a pause for a weight update.
    light_health = {"name": R.HEALTH_GENERATION_ENV, "value": "false"}
    image = ro.engine_image()
    if ro.engine == "sglang":
        command = ["python3", "-m", "sglang.launch_server", "--model-path", model.path, "--host", "127.0.0.1",
                   "--port", port, "--tp-size", tp, "--dtype", model.dtype]
        env.append(light_health)
        if model.tokenizer:
            command += ["--tokenizer-path", model.tokenizer]
        if model.revision:
            command += ["--revision", model.revision]
        if job.spec.trainer.lora is not None:  # each version an adapter the trainer loads by name
            command += sglang_lora_args(job.spec.trainer.lora)
        command += list(ro.engine_args)
    elif ro.engine == "vllm":
        lora = job.spec.trainer.lora
        extra = (["--tokenizer", model.tokenizer] if model.tokenizer else []) + (
            ["--revision", model.revision] if model.revision else []) + (
            vllm_lora_args(lora) if lora is not None else []) + list(ro.engine_args)
        command = vllm_server_command("python3", model.path, host="127.0.0.1", port=port, dtype=model.dtype,
                                      tensor_parallel=int(tp), extra=extra)
        env += [{"name": k, "value": v} for k, v in {**VLLM_SERVER_ENV, **(VLLM_LORA_ENV if lora else {})}.items()]
    else:  # hf: the asyncrl image serves the SGLang-native surface itself
        command = ["asyncrl", "engine", "--config", CONFIG_FILE, "--host", "127.0.0.1", "--port", port]
        env.append(light_health)
        image = ro.worker_image or ctx.rollout_image
    if _collective(job):  # the engine is an NCCL/Gloo peer of the trainer: the trainer's NCCL settings
        overlay_env = {e.name for e in (ro.pod_template.env if ro.pod_template and ro.pod_template.env else [])}
        env += MN.nccl_env(job.spec.trainer.nccl, overlay_env)
    container: Obj = {
        "name": "engine",
        "image": image,
        "command": command,
        "env": env,
        # Loopback only, so no probe reaches it: the proxy's readiness reports its /health. Declared
        # to say which port the engine holds in the pod.
        "ports": [{"name": "engine-local", "containerPort": ENGINE_LOCAL_PORT, "protocol": "TCP"}],
        "volumeMounts": [*_MOUNTS, _DSHM],
        "securityContext": _container_security(read_only_root=False),
    }
    resources = _resources(ro.resources, ro.gpus_per_replica)
    if resources:
        container["resources"] = resources
    return container


def engine_proxy_container(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The rollout pod's engine port: `asyncrl engine-proxy` forwards to the engine only requests that
    carry the engine API key, on every route of every engine; the kubelet's probes use its own paths.

    Readiness must hold while the trainer pauses generation for a weight update: SGLang's /health
    generates a token (it waits behind the pause, then answers 503) unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false, as engine_container sets it; vLLM's and our hf
    server's /health only read state (checked against the pins by tests/rollout/engines/test_sglang_routes.py).
    """
    return {
        "name": ENGINE_PROXY_CONTAINER,
        "image": job.spec.rollout.worker_image or ctx.rollout_image,
        "command": engine_proxy_command(port=ENGINE_PORT, upstream_port=ENGINE_LOCAL_PORT,
                                        api_key_file=f"{ENGINE_KEY_DIR}/api-key", health_path="/health"),
        "ports": [{"name": "engine", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": PROXY_READY_PATH, "port": "engine"}, "periodSeconds": 5,
                           "timeoutSeconds": 3},
        "livenessProbe": {"httpGet": {"path": PROXY_LIVE_PATH, "port": "engine"}, "periodSeconds": 20,
                          "timeoutSeconds": 3, "failureThreshold": 6},
        "volumeMounts": [{"name": ENGINE_KEY_VOLUME, "mountPath": ENGINE_KEY_DIR, "readOnly": True}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": _container_security(read_only_root=True),
    }


def worker_container(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The rollout worker: admission, generation through the engine, reward, publishing."""
    ro = job.spec.rollout
    env = [*_common_env(job, ctx), {"name": R.ENV_ENGINE_URL, "value": f"http://127.0.0.1:{ENGINE_LOCAL_PORT}"},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           # the URL the trainer uses to pause/update/resume this pod's engine
           {"name": R.ENV_ENGINE_ADVERTISE_URL, "value": f"http://$(POD_IP):{ENGINE_PORT}"},
           *_reward_env(job)]
    return {
        "name": "worker",
        "image": ro.worker_image or ctx.rollout_image,
        "command": ["asyncrl", "rollout", "--config", CONFIG_FILE],
        "env": env,
        "volumeMounts": [*_MOUNTS, _JOB_SECRETS_MOUNT],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": _container_security(read_only_root=True),
    }


def rollout_deployment(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    ro = job.spec.rollout
    selector = N.selector_labels(name, "rollout")
    replicas = 0 if ctx.stopped else ro.replicas
    return _queued(job, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(job, ctx, N.rollout(name), "rollout"),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # GPUs are the constraint: replace pods one at a time instead of surging.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": apply_pod_template({
                "metadata": {"labels": {**N.job_labels(name), **selector},
                             "annotations": _template_annotations(job, ctx)},
                "spec": {"securityContext": _pod_security(RUN_AS_USER), "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": 60,
                         "containers": [engine_container(job, ctx), engine_proxy_container(job, ctx),
                                        worker_container(job, ctx)],
                         "volumes": [*_pod_volumes(job),
                                     _secret_file_volume(ENGINE_KEY_VOLUME, N.engine_secret(name), "api-key"),
                                     _job_secrets_volume(job, status_token=False)]},
            }, ro.pod_template),
        },
    })


def _reward_deployment_spec(job: AsyncRLJob) -> RewardDeploymentSpec | None:
    service = job.spec.reward.service
    return None if service is None else service.deployment


def _reward_env(job: AsyncRLJob) -> list[Obj]:
    """For the worker: where the job's reward service answers and its key (the engine Secret's)."""
    dep = _reward_deployment_spec(job)
    if dep is None:
        return []
    return [{"name": R.ENV_REWARD_URL, "value": f"http://{N.reward(job.metadata.name)}:{dep.port}"},
            _secret_file_env(R.ENV_REWARD_API_KEY)]


def reward_deployment(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """The reward service the operator runs with the job: `asyncrl reward-server` on the job's reward
    function, or the user's own image and command; readiness on /health (open without the key)."""
    name = job.metadata.name
    dep = _reward_deployment_spec(job)
    assert dep is not None
    selector = N.selector_labels(name, "reward")
    command = dep.command or ["asyncrl", "reward-server", job.spec.reward.function, "--host", "0.0.0.0",
                              "--port", str(dep.port)]
    container: Obj = {
        "name": "reward",
        "image": dep.image or job.spec.rollout.worker_image or ctx.rollout_image,
        "command": command,
        # In the environment, not a file: the documented contract of a reward server of your own.
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": R.ENV_REWARD_API_KEY, "valueFrom": {"secretKeyRef": {
            "name": N.engine_secret(name), "key": "api-key"}}}],
        "ports": [{"name": "reward", "containerPort": dep.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "reward"}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": "reward"}, "periodSeconds": 20, "failureThreshold": 6},
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    resources = _resources(dep.resources, dep.gpus)
    if resources:
        container["resources"] = resources
    return _queued(job, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(job, ctx, N.reward(name), "reward"),
        "spec": {
            "replicas": 0 if ctx.stopped else dep.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**N.job_labels(name), **selector}},
                "spec": {"securityContext": _pod_security(RUN_AS_USER), "automountServiceAccountToken": False,
                         "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]},
            },
        },
    })


def reward_service(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    dep = _reward_deployment_spec(job)
    assert dep is not None
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, ctx, N.reward(name), "reward"),
            "spec": {"selector": N.selector_labels(name, "reward"),
                     "ports": [{"name": "reward", "port": dep.port, "targetPort": "reward", "protocol": "TCP"}]}}


def reward_network_policy(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Only the job's rollout pods (the workers score there) reach the reward service."""
    name = job.metadata.name
    dep = _reward_deployment_spec(job)
    assert dep is not None
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, ctx, N.reward(name), "reward"),
            "spec": {"podSelector": {"matchLabels": N.selector_labels(name, "reward")},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [_from_component(name, "rollout")], "ports": _tcp(dep.port)}]}}


def trainer_command(job: AsyncRLJob, namespace: str) -> list[str]:
    """torchrun over all trainer pods; rendezvous at pod 0 through the headless Service.

    Several pods use torchrun's static rendezvous with `--node-rank` = the pod's ordinal
    ($(ASYNCRL_NODE_RANK), multinode.node_rank_env), so global rank 0, which serves /status and does
    all I/O, is always pod 0, where the status Service points. The c10d backend ignores --node-rank
    and numbers nodes in the order they join: rank 0 could land on any pod. Static rendezvous has no
    membership changes, which the gang never needs: all ranks (re)start together (OnDelete)."""
    t = job.spec.trainer
    nproc = str(max(t.gpus_per_replica, 1))
    entry = ["-m", "asyncrl.cli", "trainer", "--config", CONFIG_FILE]
    if t.replicas <= 1:
        return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", *entry]
    endpoint = f"{MN.rank0_host(job.metadata.name, namespace)}:{RDZV_PORT}"
    return ["torchrun", f"--nnodes={t.replicas}", f"--nproc-per-node={nproc}", "--rdzv-backend=static",
            f"--rdzv-endpoint={endpoint}", f"--node-rank=$({MN.ENV_NODE_RANK})", f"--rdzv-id={job.metadata.name}",
            *entry]


def trainer_headless_service(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Gives each trainer pod a stable DNS name (MN.rank0_host): the rendezvous and, with
    trainer.weightTransport collective, the weight group's store on pod 0."""
    name = job.metadata.name
    ports = [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}]
    if _collective(job):
        ports.append({"name": "weight-group", "port": WEIGHT_GROUP_PORT, "targetPort": WEIGHT_GROUP_PORT,
                      "protocol": "TCP"})
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, ctx, N.trainer(name), "trainer"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": N.selector_labels(name, "trainer"),
                     "ports": ports}}


def status_service(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """Points at trainer pod 0 (global rank 0), the process that serves /status."""
    name = job.metadata.name
    port = job.spec.trainer.status_port
    selector = {**N.selector_labels(name, "trainer"),
                "statefulset.kubernetes.io/pod-name": f"{N.trainer(name)}-0"}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, ctx, N.status_service(name), "status"),
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": port, "targetPort": "status", "protocol": "TCP"}]}}


def trainer_statefulset(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    name = job.metadata.name
    t = job.spec.trainer
    selector = N.selector_labels(name, "trainer")
    replicas = 0 if ctx.stopped else t.replicas
    tracker_env, tracker_env_from = _tracker_env(job)
    overlay_env = {e.name for e in (t.pod_template.env if t.pod_template and t.pod_template.env else [])}
    collective = _collective(job)
    # collective: rank 0 hosts the weight group's store; the engines get its address from the trainer
    weight_group_env = [{"name": R.ENV_WEIGHT_GROUP_ADDRESS, "value": MN.rank0_host(name, ctx.namespace)},
                        {"name": R.ENV_WEIGHT_GROUP_PORT, "value": str(WEIGHT_GROUP_PORT)}] if collective else []
    weight_group_port = [{"name": "weight-group", "containerPort": WEIGHT_GROUP_PORT, "protocol": "TCP"}]
    container: Obj = {
        "name": "trainer",
        "image": t.image or ctx.trainer_image,
        "command": trainer_command(job, ctx.namespace),
        "env": [*_common_env(job, ctx), *tracker_env,
                _secret_file_env(R.ENV_STATUS_TOKEN),
                *([MN.node_rank_env()] if t.replicas > 1 else []),
                *weight_group_env,
                *MN.nccl_env(t.nccl, overlay_env)],
        "ports": [{"name": "status", "containerPort": t.status_port, "protocol": "TCP"},
                  {"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"},
                  *(weight_group_port if collective else [])],
        "volumeMounts": [*_MOUNTS, _DSHM, _JOB_SECRETS_MOUNT],
        "securityContext": MN.rdma_capabilities(t.rdma, _container_security(read_only_root=False)),
    }
    if tracker_env_from:  # (Kubernetes gives `env` precedence: these keys cannot shadow the operator's)
        container["envFrom"] = tracker_env_from
    resources = MN.rdma_resources(t.rdma, _resources(t.resources, t.gpus_per_replica))
    if resources:
        container["resources"] = resources
    return _queued(job, {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(job, ctx, N.trainer(name), "trainer"),
        "spec": {
            "replicas": replicas,
            "serviceName": N.trainer(name),
            # All ranks start together (Parallel) and restart together: OnDelete, and the operator deletes
            # the whole gang when any pod runs an older template (handlers._restart_stale_trainer_gang);
            # a rolling update would leave torchrun's ranks on two templates.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector},
            "template": apply_pod_template({
                "metadata": {"labels": {**N.job_labels(name), **selector},
                             "annotations": _template_annotations(job, ctx, status_token=True)},
                "spec": {"securityContext": _pod_security(RUN_AS_USER), "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": MN.termination_grace_seconds(job),
                         "containers": [container],
                         "volumes": [*_pod_volumes(job), _job_secrets_volume(job, status_token=True)]},
            }, t.pod_template),
        },
    })


def trainer_pod_disruption_budget(job: AsyncRLJob, ctx: BuildContext) -> Obj:
    """No voluntary eviction of a trainer pod (a node drain, the cluster autoscaler), owned by the job.

    The trainer is a gang: evicting one rank stops every rank (torchrun) and the step restarts from
    the last checkpoint, so one eviction costs as much as evicting all. `maxUnavailable: 0` says that
    for any replica count and needs no update when the trainer is scaled (a finished job scales it
    to zero; the disruption controller reads the StatefulSet's own replicas), where `minAvailable:
    <replicas>` would have to follow every scale. To drain a node under a running job, suspend the
    job (`spec.suspend`: the trainer goes to zero and checkpoints). `unhealthyPodEvictionPolicy:
    AlwaysAllow` lets a drain evict a pod that is not Ready (a crash-looping rank: the gang is
    already broken), so the budget never pins a node for a pod that trains nothing.
    """
    name = job.metadata.name
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(job, ctx, N.trainer(name), "trainer"),
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": N.selector_labels(name, "trainer")},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def build_children(job: AsyncRLJob, ctx: BuildContext) -> list[Obj]:
    """Every child of the job, in the order they should be applied (dependencies first)."""
    out = [config_map(job, ctx)]
    if job.spec.redis.mode == "managed":
        out += [redis_secret(job, ctx), redis_service(job, ctx), redis_statefulset(job, ctx),
                redis_network_policy(job, ctx)]
    if job.spec.storage.claim_name is None:
        out.append(shared_pvc(job, ctx))
    out += [status_secret(job, ctx), engine_secret(job, ctx), trainer_headless_service(job, ctx),
            status_service(job, ctx), trainer_network_policy(job, ctx), trainer_statefulset(job, ctx),
            trainer_pod_disruption_budget(job, ctx)]
    if _reward_deployment_spec(job) is not None:  # (before rollout: its workers score there from the start)
        out += [reward_service(job, ctx), reward_network_policy(job, ctx), reward_deployment(job, ctx)]
    out += [rollout_network_policy(job, ctx), rollout_deployment(job, ctx)]
    return out


def scaled_workloads(job: AsyncRLJob, ctx: BuildContext) -> list[Obj]:
    """The workloads that hold GPUs, as `ctx` sizes them (ctx.stopped: zero replicas, the job ended)."""
    out = [trainer_statefulset(job, ctx), rollout_deployment(job, ctx)]
    if _reward_deployment_spec(job) is not None:
        out.append(reward_deployment(job, ctx))
    return out


def rollout_selector(job_name: str) -> str:
    """The label selector of the rollout pods, published in status for the scale subresource."""
    return N.selector_string(N.selector_labels(job_name, "rollout"))


def status_url(job_name: str, namespace: str, port: int) -> str:
    """In-cluster URL of the trainer's status endpoint."""
    return f"http://{N.status_service(job_name)}.{namespace}.svc:{port}"
