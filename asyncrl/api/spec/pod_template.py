"""Per-role pod template overlays of the AsyncRLJob spec (rollout, trainer, managed Redis).

Per-role overlays a platform team needs on a shared cluster (scheduling, pull secrets, identity,
extra env and volumes). The models mirror the Kubernetes core/v1 types field for field (same wire
names), restricted to what these pods can use, so a Kubernetes user can paste what they know and a
mistake is reported here, with its field path, instead of by the API server when the operator
applies a Deployment. How an overlay is merged onto the built pods: asyncrl.operator.builders.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel, to_snake

from asyncrl.api.engine_servers import ENGINE_KEY_DIR, ENGINE_KEY_VOLUME, VLLM_SERVER_ENV
from asyncrl.api.runtime import HEALTH_GENERATION_ENV, SECRETS_DIR
from asyncrl.api.spec.base import GROUP, SpecModel, parse_quantity

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")

OPERATOR_PREFIX = f"{GROUP}/"
"""Label and annotation keys under this prefix belong to the operator (job, config and Secret hashes)."""
OPERATOR_ENV_PREFIX = "ASYNCRL_"
"""Environment variables with this prefix belong to asyncrl (asyncrl.api.runtime), now and in later versions."""
OPERATOR_POD_LABELS: frozenset[str] = frozenset({
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of", "app.kubernetes.io/component",
    # set on each pod by the workload controllers; the status Service selects on the first
    "statefulset.kubernetes.io/pod-name", "apps.kubernetes.io/pod-index", "controller-revision-hash",
    "pod-template-hash",
})
"""Pod label keys the operator sets and selects on (asyncrl.operator.names; a test keeps both in step)."""
RESTRICTED_VOLUME_TYPES = ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "csi", "downwardAPI",
                           "ephemeral")
"""Volume types an overlay may add: those the `restricted` Pod Security Standard allows (less `projected`)."""


def _dns1123_label(v: str, what: str) -> str:
    if len(v) > 63 or not _DNS1123_LABEL.fullmatch(v):
        raise ValueError(f"{what} {v!r} is not a DNS-1123 label: at most 63 lowercase letters, digits and '-', "
                         "starting and ending with a letter or digit")
    return v


def _dns1123_subdomain(v: str, what: str) -> str:
    if len(v) > 253 or not all(_DNS1123_LABEL.fullmatch(p) for p in v.split(".")):
        raise ValueError(f"{what} {v!r} is not a DNS-1123 subdomain: at most 253 characters, lowercase letters, "
                         "digits, '-' and '.', each dot-separated part starting and ending with a letter or digit")
    return v


def _qualified_name(key: str, what: str) -> str:
    """A label/annotation/taint key: an optional DNS-1123 subdomain prefix and '/', then a name of <= 63."""
    prefix, _, name = key.rpartition("/")
    ok = len(name) <= 63 and bool(_NAME_PART.fullmatch(name))
    if prefix:
        ok = ok and len(prefix) <= 253 and all(_DNS1123_LABEL.fullmatch(p) for p in prefix.split("."))
    if not ok:
        raise ValueError(f"{what} {key!r} is not a Kubernetes qualified name: [prefix/]name, name at most 63 "
                         "letters, digits, '-', '_' or '.' starting and ending with a letter or digit, prefix a "
                         "DNS-1123 subdomain")
    return key


def _label_value(value: str, what: str) -> str:
    if value and (len(value) > 63 or not _NAME_PART.fullmatch(value)):
        raise ValueError(f"{what} {value!r} is not a label value: empty, or at most 63 letters, digits, '-', '_' "
                         "or '.' starting and ending with a letter or digit")
    return value


def _label_map(v: dict[str, str] | None, what: str) -> dict[str, str] | None:
    for key, value in (v or {}).items():
        _qualified_name(key, f"{what} key")
        _label_value(value, f"{what}[{key!r}]")
    return v


def _requirement_values(operator: str, values: list[str] | None, numeric: bool = False) -> None:
    """Kubernetes' rules for match expressions: which operators take values, and how many."""
    n = len(values or [])
    if operator in ("In", "NotIn") and n == 0:
        raise ValueError(f"operator {operator!r} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and n:
        raise ValueError(f"operator {operator!r} takes no values (got {n})")
    if numeric and operator in ("Gt", "Lt") and (n != 1 or not re.fullmatch(r"-?\d+", (values or [""])[0])):
        raise ValueError(f"operator {operator!r} needs exactly one integer value")


class Toleration(SpecModel):
    """A toleration (core/v1 Toleration): lets the pods schedule onto nodes with a matching taint."""

    key: str | None = None
    """Taint key; unset (with operator Exists) tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Equal: the taint's value must equal `value`; Exists: any value (then `value` must be unset)."""
    value: str | None = None
    """Taint value to match (operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; unset matches all effects."""
    toleration_seconds: int | None = None
    """NoExecute only: how long the pod stays bound after the taint appears; unset = forever."""

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        return v if v is None else _qualified_name(v, "key")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(f"operator 'Exists' matches any value: unset value (got {self.value!r}) or use "
                             "operator 'Equal'; allowed operators: Exists, Equal")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator 'Exists' (it tolerates every taint)")
        if self.operator == "Equal" and self.value:
            _label_value(self.value, "value")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds needs effect 'NoExecute' (got effect {self.effect!r})")
        return self


class LocalObjectReference(SpecModel):
    """The name of an object in the job's namespace (e.g. an image pull Secret)."""

    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns1123_subdomain(v, "name")


class KeySelector(SpecModel):
    """One key of a Secret or ConfigMap in the job's namespace (core/v1 SecretKeySelector)."""

    name: str
    key: str
    optional: bool | None = None
    """Start the pod even if the object or key is missing."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns1123_subdomain(v, "name")

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if len(v) > 253 or not _CONFIG_KEY.fullmatch(v):
            raise ValueError(f"key {v!r} is not a valid Secret/ConfigMap key: letters, digits, '-', '_' and '.'")
        return v


_FIELD_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
                "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs")
_WHOLE_MAPS = ("metadata.labels", "metadata.annotations")
"""Only downwardAPI volumes can expose all labels/annotations; env takes one key at a time."""


class ObjectFieldSelector(SpecModel):
    """A field of the pod (core/v1 ObjectFieldSelector), e.g. `spec.nodeName`."""

    field_path: str
    api_version: str | None = None

    @field_validator("field_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v in _FIELD_PATHS or v in _WHOLE_MAPS or re.fullmatch(r"metadata\.(labels|annotations)\['[^']+'\]", v):
            return v
        raise ValueError(f"fieldPath {v!r} is not a pod field; allowed: {', '.join(_FIELD_PATHS)}, "
                         "metadata.labels['<key>'], metadata.annotations['<key>'] (and, in downwardAPI volumes, "
                         "metadata.labels, metadata.annotations)")


_RESOURCE_FIELDS = ("limits.cpu", "limits.memory", "limits.ephemeral-storage", "requests.cpu", "requests.memory",
                    "requests.ephemeral-storage")


class ResourceFieldSelector(SpecModel):
    """A resource request or limit of a container (core/v1 ResourceFieldSelector)."""

    resource: str
    container_name: str | None = None
    divisor: str | None = None

    @field_validator("resource")
    @classmethod
    def _resource(cls, v: str) -> str:
        if v in _RESOURCE_FIELDS or re.fullmatch(r"(limits|requests)\.hugepages-.+", v):
            return v
        raise ValueError(f"resource {v!r} is not allowed; allowed: {', '.join(_RESOURCE_FIELDS)}, "
                         "limits.hugepages-<size>, requests.hugepages-<size>")

    @field_validator("divisor")
    @classmethod
    def _divisor(cls, v: str | None) -> str | None:
        if v is not None:
            parse_quantity(v)
        return v


class EnvVarSource(SpecModel):
    """Where an environment variable's value comes from: exactly one of the four."""

    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None
    field_ref: ObjectFieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        set_ = [k for k in ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")
                if getattr(self, to_snake(k)) is not None]
        if len(set_) != 1:
            raise ValueError(f"valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef, "
                             f"resourceFieldRef (got {', '.join(set_) or 'none'})")
        if self.field_ref is not None and self.field_ref.field_path in _WHOLE_MAPS:
            raise ValueError(f"fieldRef {self.field_ref.field_path!r} is allowed in downwardAPI volumes only; in env "
                             "use one key, e.g. metadata.labels['<key>']")
        return self


class EnvVar(SpecModel):
    """An environment variable (core/v1 EnvVar): a literal `value` or `valueFrom` (e.g. a Secret key)."""

    name: str
    value: str | None = None
    """Literal value; `$(NAME)` expands earlier variables. Put secrets in a Secret and use valueFrom."""
    value_from: EnvVarSource | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _ENV_NAME.fullmatch(v):
            raise ValueError(f"env name {v!r} is not valid: letters, digits, '_', '-' and '.', not starting with a "
                             "digit (Kubernetes 1.30: [-._a-zA-Z][-._a-zA-Z0-9]*)")
        return v

    @model_validator(mode="after")
    def _one(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name!r}: set value or valueFrom, not both")
        return self


class EnvFromRef(SpecModel):
    """A whole ConfigMap or Secret in the job's namespace, each key becoming a variable."""

    name: str
    optional: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns1123_subdomain(v, "name")


class EnvFromSource(SpecModel):
    """Variables from every key of a ConfigMap or a Secret (core/v1 EnvFromSource): exactly one of the two."""

    prefix: str | None = None
    """Prepended to every key."""
    config_map_ref: EnvFromRef | None = None
    secret_ref: EnvFromRef | None = None

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str | None) -> str | None:
        if v and not _ENV_NAME.fullmatch(v):
            raise ValueError(f"prefix {v!r} is not a valid env name prefix ([-._a-zA-Z][-._a-zA-Z0-9]*)")
        if v and v.startswith(OPERATOR_ENV_PREFIX):
            raise ValueError(f"prefix {v!r}: names starting with {OPERATOR_ENV_PREFIX} belong to asyncrl")
        return v

    @model_validator(mode="after")
    def _one(self) -> EnvFromSource:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError("envFrom needs exactly one of configMapRef, secretRef")
        return self


class KeyToPath(SpecModel):
    """Project one key of a ConfigMap/Secret to a file."""

    key: str
    path: str = Field(min_length=1)
    """Relative path of the file inside the volume."""
    mode: int | None = Field(default=None, ge=0, le=0o777)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError(f"path {v!r} must be relative and must not contain '..'")
        return v


class ConfigMapVolumeSource(SpecModel):
    """A ConfigMap as files."""

    name: str
    items: list[KeyToPath] | None = None
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class SecretVolumeSource(SpecModel):
    """A Secret as files."""

    secret_name: str
    items: list[KeyToPath] | None = None
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class EmptyDirVolumeSource(SpecModel):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = None
    """"" (node disk) or Memory (tmpfs, counts against the container's memory limit)."""
    size_limit: str | None = None

    @field_validator("size_limit")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and parse_quantity(v) <= 0:
            raise ValueError(f"sizeLimit {v!r} must be a positive quantity such as '10Gi'")
        return v


class PersistentVolumeClaimVolumeSource(SpecModel):
    """An existing PersistentVolumeClaim in the job's namespace (e.g. a read-only model cache)."""

    claim_name: str
    read_only: bool | None = None


class CSIVolumeSource(SpecModel):
    """An inline CSI volume (e.g. the Secrets Store CSI driver)."""

    driver: str = Field(min_length=1)
    read_only: bool | None = None
    fs_type: str | None = None
    volume_attributes: dict[str, str] | None = None
    node_publish_secret_ref: LocalObjectReference | None = None


class DownwardAPIVolumeFile(SpecModel):
    """One file of pod metadata."""

    path: str = Field(min_length=1)
    field_ref: ObjectFieldSelector | None = None
    """metadata.name, .namespace, .uid, .labels, .annotations, or one label/annotation."""
    resource_field_ref: ResourceFieldSelector | None = None
    """A request or limit of the container named in containerName."""
    mode: int | None = Field(default=None, ge=0, le=0o777)

    @model_validator(mode="after")
    def _one(self) -> DownwardAPIVolumeFile:
        if (self.field_ref is None) == (self.resource_field_ref is None):
            raise ValueError(f"downwardAPI item {self.path!r} needs exactly one of fieldRef, resourceFieldRef")
        if self.field_ref is not None and not self.field_ref.field_path.startswith("metadata."):
            raise ValueError(f"fieldRef {self.field_ref.field_path!r} is allowed in env only; downwardAPI volumes "
                             "take metadata.name, metadata.namespace, metadata.uid, metadata.labels, "
                             "metadata.annotations or one label/annotation")
        if self.resource_field_ref is not None and not self.resource_field_ref.container_name:
            raise ValueError(f"downwardAPI item {self.path!r}: resourceFieldRef needs containerName in a volume")
        return self


class DownwardAPIVolumeSource(SpecModel):
    """Pod metadata as files."""

    items: list[DownwardAPIVolumeFile] | None = None
    default_mode: int | None = Field(default=None, ge=0, le=0o777)


class Volume(SpecModel):
    """An extra pod volume (core/v1 Volume): a name and one source of a type the restricted profile allows.

    Allowed: configMap, secret, emptyDir, persistentVolumeClaim, csi, downwardAPI, ephemeral (the
    `restricted` Pod Security Standard's types less `projected`): the operator's pods keep passing a
    namespace that enforces it.
    """

    name: str
    """Unique in the pod; not one of the operator's volume names."""
    config_map: ConfigMapVolumeSource | None = None
    secret: SecretVolumeSource | None = None
    empty_dir: EmptyDirVolumeSource | None = None
    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = None
    csi: CSIVolumeSource | None = None
    downward_api: DownwardAPIVolumeSource | None = Field(default=None, alias="downwardAPI")
    ephemeral: dict[str, Any] | None = Field(default=None,
                                             json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A generic ephemeral volume (`volumeClaimTemplate`), checked by the API server."""

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        sources = [k for k in data if k != "name"]
        if len(sources) != 1:
            raise ValueError(f"volume {data.get('name')!r} needs exactly one source (got "
                             f"{', '.join(sources) or 'none'}); allowed: {', '.join(RESTRICTED_VOLUME_TYPES)}")
        python_names = {"config_map": "configMap", "empty_dir": "emptyDir",
                        "persistent_volume_claim": "persistentVolumeClaim", "downward_api": "downwardAPI"}
        source = python_names.get(sources[0], sources[0])
        if source not in RESTRICTED_VOLUME_TYPES:
            raise ValueError(f"volume type {source!r} is not allowed: asyncrl pods run under the restricted Pod "
                             f"Security Standard; allowed: {', '.join(RESTRICTED_VOLUME_TYPES)}")
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns1123_label(v, "volume name")

    @field_validator("ephemeral")
    @classmethod
    def _ephemeral(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and not isinstance((v.get("volumeClaimTemplate") or {}).get("spec"), dict):
            raise ValueError("ephemeral needs volumeClaimTemplate.spec (a PersistentVolumeClaim spec)")
        return v


class VolumeMount(SpecModel):
    """Where a volume of this overlay appears in every container of the role's pods."""

    name: str
    """A volume of this overlay's `volumes`."""
    mount_path: str
    """Absolute path in the container; not one the operator mounts, and not inside its read-only config."""
    sub_path: str | None = None
    read_only: bool | None = None

    @field_validator("mount_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or ":" in v or ".." in v.split("/"):
            raise ValueError(f"mountPath {v!r} must be an absolute path without ':' or '..'")
        return v.rstrip("/") or "/"

    @field_validator("sub_path")
    @classmethod
    def _sub_path(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"subPath {v!r} must be relative and must not contain '..'")
        return v


class NodeSelectorRequirement(SpecModel):
    """A match on a node label (or field): key, operator, values."""

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] | None = None

    @model_validator(mode="after")
    def _values(self) -> NodeSelectorRequirement:
        _requirement_values(self.operator, self.values, numeric=True)
        return self


class NodeSelectorTerm(SpecModel):
    """Requirements that all must hold (terms of a NodeSelector are ORed)."""

    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(SpecModel):
    """Nodes matching any of the terms."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1)


class PreferredSchedulingTerm(SpecModel):
    """A preference with a weight (1-100) that the scheduler adds up per node."""

    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(SpecModel):
    """Which nodes the pods may (required) or should (preferred) run on."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = None


class LabelSelectorRequirement(SpecModel):
    """A match on a pod label: key, operator, values."""

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        return _qualified_name(v, "key")

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        _requirement_values(self.operator, self.values)
        return self


class LabelSelector(SpecModel):
    """Pods (or namespaces) whose labels match all of matchLabels and matchExpressions."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None

    @field_validator("match_labels")
    @classmethod
    def _labels(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return _label_map(v, "matchLabels")


class PodAffinityTerm(SpecModel):
    """Pods matching `labelSelector` in `namespaces`, within the same `topologyKey` domain (e.g. a zone)."""

    label_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    namespace_selector: LabelSelector | None = None
    topology_key: str = Field(min_length=1)
    """Node label that defines the domain, e.g. kubernetes.io/hostname or topology.kubernetes.io/zone."""

    @field_validator("topology_key")
    @classmethod
    def _topology(cls, v: str) -> str:
        return _qualified_name(v, "topologyKey")


class WeightedPodAffinityTerm(SpecModel):
    """A pod (anti-)affinity preference with a weight (1-100)."""

    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(SpecModel):
    """Co-locate with (podAffinity) or keep away from (podAntiAffinity) other pods."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = None


class Affinity(SpecModel):
    """Scheduling constraints (core/v1 Affinity)."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class PodTemplateOverlay(SpecModel):
    """What a platform adds to a role's pods: scheduling, identity, pull secrets, env, volumes, metadata.

    The operator owns everything else (containers' commands, images, ports, probes, resources and
    security contexts; the selector labels). Merge rules (asyncrl.operator.builders.apply_pod_template):
    fields the operator leaves unset are taken as given; labels, annotations, env, envFrom, volumes and
    volumeMounts are added after the operator's, and a name the operator uses is rejected here rather
    than silently overridden. env, envFrom and volumeMounts go to every container of the pod.
    """

    ROLE: ClassVar[str] = "any"
    RESERVED_ENV: ClassVar[frozenset[str]] = frozenset()
    """Exact env names the operator sets on this role's containers (besides the ASYNCRL_ prefix)."""
    RESERVED_VOLUMES: ClassVar[frozenset[str]] = frozenset()
    RESERVED_MOUNTS: ClassVar[tuple[str, ...]] = ()
    READ_ONLY_MOUNTS: ClassVar[tuple[str, ...]] = ()
    """Operator mounts nothing may be mounted inside (their volume is read-only)."""

    labels: dict[str, str] | None = None
    """Pod labels (e.g. cost allocation, policy); keys the operator sets or selects on are rejected."""
    annotations: dict[str, str] | None = None
    """Pod annotations (e.g. for a service mesh or a log shipper); `asyncrl.dev/` keys are the operator's."""
    node_selector: dict[str, str] | None = None
    """Node labels the pods' nodes must carry, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}."""
    tolerations: list[Toleration] | None = None
    """Taints the pods tolerate, e.g. the nvidia.com/gpu NoSchedule taint of GPU nodes."""
    affinity: Affinity | None = None
    """Node affinity and pod (anti-)affinity."""
    priority_class_name: str | None = None
    """A PriorityClass for the pods (preemption order on a shared cluster)."""
    scheduler_name: str | None = None
    """The scheduler that places the pods (e.g. a batch scheduler); unset = the default scheduler."""
    service_account_name: str | None = None
    """Run as this ServiceAccount (e.g. for workload identity); its API token stays unmounted."""
    image_pull_secrets: list[LocalObjectReference] | None = None
    """Secrets with registry credentials for the role's images."""
    env: list[EnvVar] | None = None
    """Variables added to every container after the operator's (e.g. HF_TOKEN from a Secret)."""
    env_from: list[EnvFromSource] | None = None
    """ConfigMaps/Secrets whose keys become variables; the operator's variables win on a clash."""
    volumes: list[Volume] | None = None
    """Extra pod volumes, next to the operator's."""
    volume_mounts: list[VolumeMount] | None = None
    """Mounts of `volumes` into every container."""

    @classmethod
    def _reserved_env_text(cls) -> str:
        return ", ".join([f"{OPERATOR_ENV_PREFIX}*", *sorted(cls.RESERVED_ENV)])

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key in v or {}:
            if key in OPERATOR_POD_LABELS or key.startswith(OPERATOR_PREFIX):
                raise ValueError(f"label {key!r} is set by the operator or its controllers (it selects pods on "
                                 f"it); reserved: {OPERATOR_PREFIX}*, {', '.join(sorted(OPERATOR_POD_LABELS))}")
        return _label_map(v, "label")

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key in v or {}:
            _qualified_name(key, "annotation key")
            if key.startswith(OPERATOR_PREFIX):
                raise ValueError(f"annotation {key!r}: keys under {OPERATOR_PREFIX} belong to the operator")
        return v

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return _label_map(v, "nodeSelector")

    @field_validator("priority_class_name", "scheduler_name", "service_account_name")
    @classmethod
    def _object_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _dns1123_subdomain(v, to_camel(info.field_name or "name"))

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[EnvVar] | None) -> list[EnvVar] | None:
        seen: set[str] = set()
        for i, var in enumerate(v or []):
            if var.name.startswith(OPERATOR_ENV_PREFIX) or var.name in cls.RESERVED_ENV:
                raise ValueError(f"env[{i}].name {var.name!r} is set by the operator on {cls.ROLE} pods and cannot be "
                                 f"redefined; reserved: {cls._reserved_env_text()}")
            if var.name in seen:
                raise ValueError(f"env[{i}].name {var.name!r} is defined twice")
            seen.add(var.name)
        return v

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, v: list[Volume] | None) -> list[Volume] | None:
        seen: set[str] = set()
        for i, vol in enumerate(v or []):
            if vol.name in cls.RESERVED_VOLUMES:
                raise ValueError(f"volumes[{i}].name {vol.name!r} is a volume the operator creates on {cls.ROLE} "
                                 f"pods; reserved: {', '.join(sorted(cls.RESERVED_VOLUMES))}")
            if vol.name in seen:
                raise ValueError(f"volumes[{i}].name {vol.name!r} is used twice: volume names must be unique")
            seen.add(vol.name)
        return v

    @field_validator("volume_mounts")
    @classmethod
    def _mounts(cls, v: list[VolumeMount] | None) -> list[VolumeMount] | None:
        seen: set[str] = set()
        for i, m in enumerate(v or []):
            inside = [p for p in cls.READ_ONLY_MOUNTS if m.mount_path.startswith(p + "/")]
            if m.mount_path in cls.RESERVED_MOUNTS or inside:
                raise ValueError(f"volumeMounts[{i}].mountPath {m.mount_path!r} is where the operator mounts its own "
                                 f"volumes on {cls.ROLE} pods; reserved: {', '.join(cls.RESERVED_MOUNTS)}"
                                 + (f" (and anything inside the read-only {inside[0]})" if inside else ""))
            if m.mount_path in seen:
                raise ValueError(f"volumeMounts[{i}].mountPath {m.mount_path!r} is used twice")
            seen.add(m.mount_path)
        return v

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> PodTemplateOverlay:
        names = [vol.name for vol in self.volumes or []]
        for i, m in enumerate(self.volume_mounts or []):
            if m.name not in names:
                raise ValueError(f"volumeMounts[{i}].name {m.name!r} names no volume of this podTemplate; "
                                 f"allowed: {', '.join(names) or '(no volumes set)'}")
        return self


_POD_ENV = frozenset({"HOME", "HF_HOME"})
_POD_VOLUMES = frozenset({"config", "shared", "tmp", "dshm", "job-secrets"})
_POD_MOUNTS = ("/etc/asyncrl", "/shared", "/tmp", "/dev/shm", SECRETS_DIR)
_READ_ONLY_MOUNTS = ("/etc/asyncrl", SECRETS_DIR)


class RolloutPodTemplate(PodTemplateOverlay):
    """Added to the rollout pods (engine and worker containers; not the engine proxy); merge rules:
    docs/operator.md, Pod templates."""

    ROLE: ClassVar[str] = "rollout"
    RESERVED_ENV: ClassVar[frozenset[str]] = _POD_ENV | {"POD_IP", "VLLM_API_KEY", HEALTH_GENERATION_ENV,
                                                         *VLLM_SERVER_ENV}
    RESERVED_VOLUMES: ClassVar[frozenset[str]] = _POD_VOLUMES | {ENGINE_KEY_VOLUME}
    RESERVED_MOUNTS: ClassVar[tuple[str, ...]] = (*_POD_MOUNTS, ENGINE_KEY_DIR)
    READ_ONLY_MOUNTS: ClassVar[tuple[str, ...]] = (*_READ_ONLY_MOUNTS, ENGINE_KEY_DIR)


class TrainerPodTemplate(PodTemplateOverlay):
    """Added to the trainer pods (every rank); merge rules: docs/operator.md, Pod templates."""

    ROLE: ClassVar[str] = "trainer"
    RESERVED_ENV: ClassVar[frozenset[str]] = _POD_ENV
    RESERVED_VOLUMES: ClassVar[frozenset[str]] = _POD_VOLUMES
    RESERVED_MOUNTS: ClassVar[tuple[str, ...]] = _POD_MOUNTS
    READ_ONLY_MOUNTS: ClassVar[tuple[str, ...]] = _READ_ONLY_MOUNTS


class RedisPodTemplate(PodTemplateOverlay):
    """Added to the managed Redis pod; merge rules: docs/operator.md, Pod templates."""

    ROLE: ClassVar[str] = "redis"
    RESERVED_ENV: ClassVar[frozenset[str]] = frozenset({"REDISCLI_AUTH"})
    # redis-conf at /run/redis: the in-memory file that carries the password (never on argv); redis-auth:
    # the Secret's password as a file
    RESERVED_VOLUMES: ClassVar[frozenset[str]] = frozenset({"data", "redis-conf", "redis-auth"})
    RESERVED_MOUNTS: ClassVar[tuple[str, ...]] = ("/data", "/run/redis", "/var/run/secrets/asyncrl/redis")
