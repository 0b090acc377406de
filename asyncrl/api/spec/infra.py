"""What a job runs on and writes to: container resources, the Redis its trajectories travel
through, the shared volume for weights and checkpoints, and the experiment trackers its figures
go to (with the Secrets that hold their credentials)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.api.spec.base import CelRule, ImageRef, SpecModel, parse_quantity
from asyncrl.api.spec.pod_template import RedisPodTemplate


class Resources(SpecModel):
    """Container resources. Quantities use Kubernetes syntax; `gpu` is a whole number of GPUs."""

    cpu: str | None = None
    """CPU request and limit, e.g. "4" or "500m"."""
    memory: str | None = None
    """Memory request and limit, e.g. "32Gi"."""
    ephemeral_storage: str | None = None
    """Ephemeral storage request, e.g. "20Gi"."""

    @field_validator("cpu", "memory", "ephemeral_storage", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)
        if not isinstance(v, str):
            raise ValueError("must be a Kubernetes quantity string such as '2', '500m' or '16Gi'")
        if parse_quantity(v) < 0:
            raise ValueError(f"{v!r} is negative; quantities must be >= 0")
        return v


class SecretKeyRef(SpecModel):
    """A key inside a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    key: str = Field(default="url", min_length=1)


class RedisResources(Resources):
    """The managed Redis's resources: requested and limited by default, so its pod is not
    BestEffort (the first evicted, and refused where a ResourceQuota needs requests). Its
    `maxmemory` is 90% of the memory limit, with no eviction: a full Redis refuses new trajectories
    (the rollout worker retries, the job shows it) instead of evicting ones not yet trained."""

    cpu: str | None = "1"
    """CPU request and limit."""
    memory: str | None = "2Gi"
    """Memory request and limit; Redis's maxmemory is 90% of it (null: no limit and no maxmemory)."""


class ManagedRedis(SpecModel):
    """A Redis that the operator runs for the job."""

    image: ImageRef = "redis:7.4-alpine"
    """Redis image, [registry/]name[:tag][@sha256:<digest>]."""
    append_only: bool = True
    """AOF persistence with appendfsync always (recommended: nothing acknowledged is lost, even on a kill)."""
    storage: str = "2Gi"
    """PVC size for the AOF."""
    storage_class_name: str | None = None
    resources: RedisResources = Field(default_factory=RedisResources)
    pod_template: RedisPodTemplate | None = None
    """Scheduling, identity, env and volumes added to the Redis pod (part of spec.redis: immutable)."""

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        if parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be a positive quantity such as '2Gi'")
        return v


class ExternalRedis(SpecModel):
    """An existing Redis; its URL (redis:// or rediss://, may carry a password) is in a Secret."""

    url_secret: SecretKeyRef


class RedisSpec(SpecModel):
    """Where trajectories travel."""

    mode: Literal["managed", "external"] = "managed"
    managed: ManagedRedis = Field(default_factory=ManagedRedis)
    external: ExternalRedis | None = None

    __cel_rules__ = (CelRule("self.mode != 'external' || has(self.external)",
                             "mode 'external' requires external.urlSecret"),)

    @model_validator(mode="after")
    def _external(self) -> RedisSpec:
        if self.mode == "external" and self.external is None:
            raise ValueError("mode 'external' requires external.urlSecret (name and key of the Secret)")
        return self


class StorageSpec(SpecModel):
    """The shared volume for weight versions and checkpoints (ReadWriteMany across pods)."""

    claim_name: str | None = None
    """Use this existing PVC; otherwise the operator creates one of `size`."""
    size: str = "100Gi"
    storage_class_name: str | None = None
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"
    delete_with_job: bool = False
    """Own the volume the operator creates: deleting the job (or its TTL) then deletes it too.
    Off by default, so the volume (the only copy of the trained weights) outlives the job."""

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        if parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be a positive quantity such as '100Gi'")
        return v


# ----------------------------------------------------------------------------------- trackers


class TensorBoardSpec(SpecModel):
    """TensorBoard event files (needs the `tensorboard` extra: pip install 'asyncrl[tensorboard]')."""

    log_dir: str | None = None
    """Where the event files go; unset = `tensorboard/` in the run directory (on a cluster: on the
    job's volume, beside the checkpoints)."""


class WandbKeyRef(SecretKeyRef):
    """The Secret key holding a Weights & Biases API key."""

    key: str = Field(default="WANDB_API_KEY", min_length=1)


class WandbSpec(SpecModel):
    """Weights & Biases (needs the `wandb` extra: pip install 'asyncrl[wandb]')."""

    project: str = Field(min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline"] = "online"
    """offline: write the run under the run directory for a later `wandb sync`."""
    tags: list[str] = Field(default_factory=list)
    api_key_secret: WandbKeyRef | None = None
    """On a cluster: the Secret key holding WANDB_API_KEY (set as the trainer's environment)."""


class MlflowSpec(SpecModel):
    """MLflow (needs the `mlflow` extra: pip install 'asyncrl[mlflow]')."""

    tracking_uri: str | None = None
    """Tracking server URL; unset = a file store `mlruns/` in the run directory."""
    experiment: str = Field(default="asyncrl", min_length=1)
    credentials_secret: str | None = None
    """On a cluster: a Secret whose keys (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD or
    MLFLOW_TRACKING_TOKEN) become the trainer's environment."""


class LoggingSpec(SpecModel):
    """Experiment trackers that receive the per-step figures of /status (and the eval results)."""

    tensorboard: TensorBoardSpec | None = None
    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None
