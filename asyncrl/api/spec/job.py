"""The AsyncRLJob resource: its names, its metadata, the spec's root (every part, and the rules that
read several parts at once), the fields that cannot change on a running job, and the status."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from asyncrl.api.spec.algorithm import VCPO_BASELINE_OFF_CEL, AlgorithmSpec, StalenessSpec
from asyncrl.api.spec.base import GROUP, CelRule, SpecModel
from asyncrl.api.spec.infra import LoggingSpec, RedisSpec, StorageSpec
from asyncrl.api.spec.lora import ALL_LINEAR, SGLANG_TARGET_MODULES, VLLM_MAX_LORA_RANKS
from asyncrl.api.spec.model_data import (
    UNIQUE_NAMES_CEL,
    DatasetSourceSpec,
    DatasetSpec,
    EvaluationSpec,
    ModelSpec,
    check_sources,
    with_default_dataset,
)
from asyncrl.api.spec.reward import REWARD_SERVICE_ONE_OF, RewardSpec
from asyncrl.api.spec.rollout import RolloutSpec
from asyncrl.api.spec.status import AsyncRLJobStatus
from asyncrl.api.spec.trainer import TrainerSpec

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AsyncRLJob"
PLURAL = "asyncrljobs"
SINGULAR = "asyncrljob"
SHORT_NAMES = ["arj"]

# DNS-1035 label: Services are named after the job, and Service names must be DNS-1035 labels.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MAX = 63
LORA_VLLM_RANK_MESSAGE = (f"trainer.lora.rank with rollout.engine vllm must be at most {VLLM_MAX_LORA_RANKS[-1]} "
                          "(vLLM's largest --max-lora-rank)")
LORA_SGLANG_MODULES_MESSAGE = ("trainer.lora.targetModules with rollout.engine sglang must be all-linear or modules "
                               f"SGLang serves adapters on: {', '.join(SGLANG_TARGET_MODULES)}")
LORA_TRANSPORT_MESSAGE = ("trainer.lora needs trainer.weightTransport disk: an adapter version is megabytes on the "
                          "weights volume (the collective transport does not carry adapters yet)")
COLLECTIVE_ENGINES = ("sglang", "hf")
"""Engines that can join the trainer's weight group (trainer.weightTransport collective)."""
_ONE_TRAINER_PROCESS_CEL = ("((has(self.trainer) && has(self.trainer.replicas) ? self.trainer.replicas : 1)"
                            " * (has(self.trainer) && has(self.trainer.gpusPerReplica)"
                            " && self.trainer.gpusPerReplica > 1 ? self.trainer.gpusPerReplica : 1)) == 1")
"""CEL on `spec`: the trainer runs as one process (TrainerSpec.processes)."""
_ENGINE_CEL = "(has(self.rollout) && has(self.rollout.engine) ? self.rollout.engine : 'sglang')"
"""CEL on `spec`: the rollout engine, defaulted."""
_DATASET_ONE_OF = "set dataset (one source) or datasets (a mixture), not both"
_UNIQUE_SOURCE_NAMES = "each source of datasets needs a name of its own"


class AsyncRLJobSpec(SpecModel):
    """What to train, on what, and how."""

    model: ModelSpec
    dataset: DatasetSpec | None = None
    """The prompts, from one source (or use `datasets` for a mixture); unset = builtin:arithmetic
    when `datasets` is unset too."""
    datasets: list[DatasetSourceSpec] | None = Field(default=None, min_length=1, max_length=64)
    """A mixture of sources instead of `dataset`: each prompt is drawn from a source chosen by weight,
    deterministically from the job's seed, so a restarted worker resumes every source where it was.
    Per-source figures: `reward_by_source` and `groups_by_source` (docs/rollout.md, "Mixtures")."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    staleness: StalenessSpec = Field(default_factory=StalenessSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    redis: RedisSpec = Field(default_factory=RedisSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    evaluation: EvaluationSpec | None = None
    """Held-out evaluation during training; unset = none."""
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    """Experiment trackers (TensorBoard, Weights & Biases, MLflow); none by default."""
    suspend: bool = False
    """Scale rollout and trainer to zero, keeping Redis and volumes; unset to resume."""
    queue_name: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Kueue LocalQueue (in the job's namespace) that admits the trainer and the rollout: the
    `kueue.x-k8s.io/queue-name` label on their StatefulSet, Deployment and pods. Kueue holds the pods
    (a scheduling gate) until it admits them; the job is then Pending/Queued and its startup deadline
    counts from admission (docs/operator.md, "Queueing with Kueue")."""
    startup_deadline_seconds: int = Field(default=900, ge=1)
    """Fail the job if it is not Running this long after creation (with the pods' reason)."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job (DeadlineExceeded) if it has not finished this long after it started (or was
    last resumed); unset = no limit. GPUs are released as for any finished job."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the job this long after it succeeds or fails; unset = keep."""
    seed: int = 0
    """Global seed (sampling, initialisation order, data order)."""

    __cel_rules__ = (
        # _one_dataset_field
        CelRule("!has(self.dataset) || !has(self.datasets)", _DATASET_ONE_OF),
        CelRule(UNIQUE_NAMES_CEL, _UNIQUE_SOURCE_NAMES, at="datasets"),
        # RewardServiceSpec._one_of, for the job's own reward
        REWARD_SERVICE_ONE_OF.under("reward.service"),
        # _tb_in_one_process
        CelRule("!has(self.algorithm) || !has(self.algorithm.objective) || self.algorithm.objective != 'tb'"
                " || " + _ONE_TRAINER_PROCESS_CEL,
                "objective 'tb' needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)"),
        # _sync_lag_within_bound
        CelRule("!has(self.trainer) || !has(self.trainer.weightSyncLag) || self.trainer.weightSyncLag == 0"
                " || (has(self.staleness) && has(self.staleness.asyncRatio)"
                " ? double(self.trainer.weightSyncLag) - 1.0 < self.staleness.asyncRatio"
                " : self.trainer.weightSyncLag <= (has(self.staleness) && has(self.staleness.maxHeadOffpolicyness)"
                " ? self.staleness.maxHeadOffpolicyness : 4))",
                "trainer.weightSyncLag must be <= the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))"),
        # _collective_needs_a_group_engine
        CelRule("!has(self.trainer) || !has(self.trainer.weightTransport)"
                f" || self.trainer.weightTransport != 'collective' || {_ENGINE_CEL} in ['sglang', 'hf']",
                "trainer.weightTransport 'collective' needs rollout.engine sglang or hf (vLLM 0.32's own weight "
                "transfer is another protocol, not spoken yet); allowed with vllm: disk"),
        # _vcpo_baseline_in_one_process
        CelRule("!has(self.algorithm) || " + VCPO_BASELINE_OFF_CEL.replace("self.", "self.algorithm.")
                + " || " + _ONE_TRAINER_PROCESS_CEL,
                "algorithm.vcpo.baseline needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)"),
        # _lora_fits_the_engine_and_transport
        CelRule("!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.rank)"
                f" || {_ENGINE_CEL} != 'vllm' || self.trainer.lora.rank <= {VLLM_MAX_LORA_RANKS[-1]}",
                LORA_VLLM_RANK_MESSAGE),
        CelRule("!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.weightTransport)"
                " || self.trainer.weightTransport == 'disk'", LORA_TRANSPORT_MESSAGE),
        CelRule("!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.targetModules)"
                f" || {_ENGINE_CEL} != 'sglang'"
                " || self.trainer.lora.targetModules.all(m, m in " + str([*SGLANG_TARGET_MODULES, ALL_LINEAR]) + ")",
                LORA_SGLANG_MODULES_MESSAGE),
    )
    """The rules that read several parts of the spec (the validators named in the comments), and the
    list and nested-object rules of `datasets` and `reward`."""

    @model_validator(mode="before")
    @classmethod
    def _default_dataset(cls, data: Any) -> Any:
        return with_default_dataset(data)

    @model_validator(mode="after")
    def _one_dataset_field(self) -> AsyncRLJobSpec:
        check_sources(self.dataset, self.datasets, _DATASET_ONE_OF, _UNIQUE_SOURCE_NAMES)
        return self

    @model_validator(mode="after")
    def _sync_lag_within_bound(self) -> AsyncRLJobSpec:
        lag, bound = self.trainer.weight_sync_lag, self.staleness.as_policy().version_bound
        if lag > bound:
            raise ValueError(f"trainer.weightSyncLag {lag} exceeds the staleness bound {bound} "
                             "(staleness.maxHeadOffpolicyness, or ceil(asyncRatio) for policy 'per-sample'): "
                             f"every group would be dropped as too stale; allowed: 0 to {bound}")
        return self

    @model_validator(mode="after")
    def _collective_needs_a_group_engine(self) -> AsyncRLJobSpec:
        if self.trainer.weight_transport == "collective" and self.rollout.engine not in COLLECTIVE_ENGINES:
            raise ValueError(f"trainer.weightTransport 'collective' needs rollout.engine sglang or hf, got "
                             f"rollout.engine '{self.rollout.engine}' (vLLM 0.32's own weight transfer is another "
                             "protocol, not spoken yet); "
                             f"allowed with {self.rollout.engine}: disk")
        return self

    @model_validator(mode="after")
    def _lora_fits_the_engine_and_transport(self) -> AsyncRLJobSpec:
        if self.trainer.lora is None:
            return self
        if self.rollout.engine == "vllm" and self.trainer.lora.rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(LORA_VLLM_RANK_MESSAGE + f", got {self.trainer.lora.rank}")
        if self.trainer.weight_transport != "disk":
            raise ValueError(LORA_TRANSPORT_MESSAGE + f", got '{self.trainer.weight_transport}'")
        unserved = [m for m in self.trainer.lora.target_modules if m not in (*SGLANG_TARGET_MODULES, ALL_LINEAR)]
        if self.rollout.engine == "sglang" and unserved:
            raise ValueError(LORA_SGLANG_MODULES_MESSAGE + f"; got {', '.join(unserved)}")
        return self

    @model_validator(mode="after")
    def _vcpo_baseline_in_one_process(self) -> AsyncRLJobSpec:
        processes = self.trainer.processes
        if self.algorithm.vcpo.baseline and processes > 1:
            raise ValueError(f"algorithm.vcpo.baseline needs one trainer process, got trainer.replicas "
                             f"{self.trainer.replicas} x gpusPerReplica {self.trainer.gpus_per_replica}: the "
                             "per-trajectory gradient norms are not gathered across ranks yet; allowed: "
                             "trainer.replicas 1 with gpusPerReplica 0 or 1, or vcpo.baseline false")
        return self

    @model_validator(mode="after")
    def _tb_in_one_process(self) -> AsyncRLJobSpec:
        processes = self.trainer.processes
        if self.algorithm.objective == "tb" and processes > 1:
            raise ValueError(f"algorithm.objective 'tb' needs one trainer process, got trainer.replicas "
                             f"{self.trainer.replicas} x gpusPerReplica {self.trainer.gpus_per_replica}: the "
                             "groups' log-partition sums, the reference model and the replay buffer are not "
                             "shared across ranks yet; allowed: trainer.replicas 1 with gpusPerReplica 0 or 1")
        return self

    def training_datasets(self) -> list[DatasetSpec]:
        """The sources of training prompts: `datasets`, else the one `dataset` (one is always set)."""
        if self.datasets is not None:
            return list(self.datasets)
        assert self.dataset is not None  # (_one_dataset_field: one of dataset and datasets)
        return [self.dataset]

    def max_response_tokens(self) -> int:
        """The longest response a trainable group may carry: one answer (algorithm.maxNewTokens), or a
        multi-turn episode's turns and observations (rollout.episodeLimits.maxTokens)."""
        if self.rollout.multi_turn():
            return self.rollout.episode_limits.max_tokens
        return self.algorithm.max_new_tokens

    def max_concurrent_groups(self) -> int:
        """Groups in flight across all rollout pods (explicit, or B + the policy's groups ahead)."""
        s = self.staleness
        if s.max_concurrent_groups is not None:
            return s.max_concurrent_groups
        return self.algorithm.batch_size + s.as_policy().groups_ahead(self.algorithm.batch_size)


class ObjectMeta(SpecModel):
    """The parts of Kubernetes metadata a job file carries (server fields are accepted and kept)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=JOB_NAME_MAX)
    """Job name: lowercase letters, digits and '-', starting with a letter (DNS-1035 label)."""
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(JOB_NAME_PATTERN, v):
            raise ValueError(
                f"{v!r} is not a valid job name: use lowercase letters, digits and '-', "
                "start with a letter and end with a letter or digit (DNS-1035 label)"
            )
        return v


class AsyncRLJob(SpecModel):
    """An asynchronous RL post-training job."""

    api_version: Literal["asyncrl.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["AsyncRLJob"]
    metadata: ObjectMeta
    spec: AsyncRLJobSpec
    status: AsyncRLJobStatus | None = None


# Fields that cannot change on a running job: (json path, message).
IMMUTABLE_FIELDS: list[tuple[str, str]] = [
    ("spec.model", "model is immutable: create a new job to train another model"),
    ("spec.rollout.engine", "rollout.engine is immutable"),
    ("spec.trainer.lora", "trainer.lora is immutable: the checkpoints hold an adapter of this shape"),
    ("spec.redis", "redis is immutable: trajectories in flight live there"),
    ("spec.storage", "storage is immutable: weights and checkpoints live there"),
    ("spec.algorithm.groupSize", "algorithm.groupSize is immutable"),
    ("spec.algorithm.batchSize", "algorithm.batchSize is immutable (admission counts in batches)"),
]
