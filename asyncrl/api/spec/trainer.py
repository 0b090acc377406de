"""`spec.trainer`: the PyTorch trainer's pods and processes, how it publishes weights, and the NCCL
and RDMA settings of a multi-node trainer."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from asyncrl.api.spec.base import ImageRef, SpecModel
from asyncrl.api.spec.infra import Resources
from asyncrl.api.spec.lora import LoraSpec
from asyncrl.api.spec.pod_template import TrainerPodTemplate

NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
_IFNAME_LIST = re.compile(r"^[\^=]?[A-Za-z0-9_.:@-]{1,15}(,[A-Za-z0-9_.:@-]{1,15})*$")
_HCA_LIST = re.compile(r"^[\^=]?[A-Za-z0-9_.-]+(:[0-9]+)?(,[A-Za-z0-9_.-]+(:[0-9]+)?)*$")


class NcclSettings(SpecModel):
    """The NCCL settings a multi-node trainer usually needs, as typed fields (each becomes the env var
    named below on every trainer container). Any other NCCL_* variable goes in
    spec.trainer.podTemplate.env; a variable set there wins over the field here."""

    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the interfaces for bootstrap and socket traffic, e.g.
    "eth0", "^lo,docker" (exclude) or "=eth1" (exact)."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: the InfiniBand/RoCE adapters to use, e.g. "mlx5_0,mlx5_1", "=mlx5_0:1" or "^mlx5_3"."""
    ib_disable: bool | None = None
    """NCCL_IB_DISABLE=1 when true: sockets only (no InfiniBand/RoCE)."""
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = None
    """NCCL_DEBUG: VERSION | WARN | INFO | TRACE."""

    @field_validator("socket_ifname")
    @classmethod
    def _ifname(cls, v: str | None) -> str | None:
        if v is not None and not _IFNAME_LIST.match(v):
            raise ValueError(f"{v!r} is not an interface list: names of at most 15 characters, comma-separated, "
                             "optionally prefixed by '^' (exclude) or '=' (exact), e.g. 'eth0' or '^lo,docker'")
        return v

    @field_validator("ib_hca")
    @classmethod
    def _hca(cls, v: str | None) -> str | None:
        if v is not None and not _HCA_LIST.match(v):
            raise ValueError(f"{v!r} is not an HCA list: device[:port], comma-separated, optionally prefixed by "
                             "'^' (exclude) or '=' (exact), e.g. 'mlx5_0,mlx5_1' or '=mlx5_0:1'")
        return v


_EXTENDED_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
                                r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class RdmaSettings(SpecModel):
    """RDMA (InfiniBand/RoCE) for the trainer's NCCL traffic: an opt-in, because IPC_LOCK is a
    capability the `restricted` Pod Security profile forbids (the namespace must allow `privileged`)."""

    resource_name: str | None = None
    """Extended resource of the RDMA device plugin each trainer pod requests, e.g. "rdma/rdma_shared_device_a"
    or "nvidia.com/hostdev"; unset: no device request (RDMA through e.g. host devices or an overlay)."""
    count: int = Field(default=1, ge=1)
    """How many of `resourceName` each trainer pod requests."""
    ipc_lock: bool = True
    """Add the IPC_LOCK capability: RDMA pins (registers) memory, which the default memlock limit refuses."""

    @field_validator("resource_name")
    @classmethod
    def _resource(cls, v: str | None) -> str | None:
        if v is not None and not _EXTENDED_RESOURCE.match(v):
            raise ValueError(f"{v!r} is not an extended resource name: <domain>/<name>, e.g. "
                             "'rdma/rdma_shared_device_a' or 'nvidia.com/hostdev'")
        if v is not None and v.split("/")[0] == "kubernetes.io":
            raise ValueError(f"{v!r}: the kubernetes.io domain holds no device-plugin resources")
        return v


class TrainerSpec(SpecModel):
    """The PyTorch trainer."""

    replicas: int = Field(default=1, ge=0)
    """Trainer nodes (pods); torchrun spans all of them."""
    gpus_per_replica: int = Field(default=1, ge=0)
    """GPUs per trainer pod (processes per node)."""
    image: ImageRef | None = None
    """Trainer image, [registry/]name[:tag][@sha256:<digest>] (a digest pins it; kept as given); default:
    the asyncrl trainer image of the operator's version."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes; auto = cuda when GPUs are requested or visible."""
    parallelism: Literal["fsdp", "ddp"] = "fsdp"
    """How several trainer processes share the model: fsdp (FSDP2: parameters, gradients and AdamW
    state sharded across ranks, a float32 master copy with compute in model.dtype) or ddp (every
    rank holds all of them). One process holds the whole model either way."""
    weight_transport: Literal["disk", "collective"] = "disk"
    """How published weights reach the engines. disk: every engine loads weights/v{N} from the shared
    volume. collective: the trainer's rank 0 and every engine form one process group (NCCL for sglang,
    gloo for hf) and rank 0 broadcasts each version in buckets; disk stays for engines that join late
    or restart and for any broadcast that fails. vllm engines: disk only (vLLM 0.32's own NCCL
    weight transfer is another protocol, not spoken yet)."""
    checkpoint_interval: int = Field(default=10, ge=1)
    """Steps between checkpoints."""
    max_steps: int = Field(default=100, ge=1)
    """Training steps after which the job succeeds."""
    backoff_limit: int = Field(default=3, ge=0)
    """Restarts of a trainer container the job tolerates: one more fails it (BackoffLimitExceeded).
    A trainer that exits with code 78 (a configuration error) fails the job at once."""
    status_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the trainer's status endpoint."""
    max_non_finite_steps: int = Field(default=3, ge=1)
    """Steps in a row whose every update had a non-finite gradient norm before the job fails
    (NonFiniteGradients). Such an update is skipped (weights and optimizer state unchanged); the
    step still consumes its groups and publishes the next policy version."""
    stall_after_seconds: int = Field(default=60, ge=5)
    """How long no group may be accepted for training, while groups are being dropped (reward,
    episode or generation failures, too stale, an engine gone) or none are generated, before the
    trainer reports a stall: its /status `stalled`, `asyncrl run`'s progress line, the dashboard and
    the job's Degraded condition name the dominant cause with its count and last error. Reporting
    only; the job goes on (see progressDeadlineSeconds)."""
    progress_deadline_seconds: int | None = Field(default=None, ge=10)
    """Fail the job (ProgressDeadlineExceeded, the stall's cause in the message) when no training step
    finished this long (counted from the last step, or from when the first rollout engine registered:
    start-up has startupDeadlineSeconds). Unset = off: a step's time depends on the model, the batch
    and the episodes (minutes for a large model or long agent episodes), so no default fits every
    job; set it to a few times your step time."""
    weight_sync_lag: int = Field(default=0, ge=0)
    """Experiment knob for staleness studies (0 in production): when version v is published the
    engines are told to load version max(v - lag, 0), so every trained batch is at least `lag`
    versions stale. At most the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))."""
    lora: LoraSpec | None = None
    """Train LoRA adapters on the frozen base model instead of every weight (present = on): each version
    published is an adapter directory the engines hot-load (SGLang, vLLM and hf). Needs weightTransport
    disk; cannot change on a running job."""
    resources: Resources = Field(default_factory=Resources)
    nccl: NcclSettings | None = None
    """NCCL settings for multi-node training (interfaces, InfiniBand adapters, debug level)."""
    rdma: RdmaSettings | None = None
    """RDMA opt-in: the device plugin's resource and IPC_LOCK (needs a `privileged` Pod Security namespace)."""
    termination_grace_period_seconds: int | None = Field(default=None, ge=30, le=86400)
    """Seconds a stopping trainer pod has to write its last checkpoint before it is killed; unset: derived
    from the model's size (docs/operator.md, "Multi-node trainer"), at least 120."""
    pod_template: TrainerPodTemplate | None = None
    """Scheduling, identity, env and volumes added to the trainer pods."""

    @property
    def processes(self) -> int:
        """Trainer processes (ranks): one per GPU of each replica, one per CPU-only replica."""
        return self.replicas * max(self.gpus_per_replica, 1)
