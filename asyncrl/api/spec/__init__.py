"""The AsyncRLJob API: pydantic models that are the single source of the job contract.

The same models validate `asyncrl validate` input, drive `asyncrl run` on one machine, are
reconciled by the operator, and generate the CRD's openAPIV3Schema (asyncrl.api.crd). Field names
are camelCase on the wire (Kubernetes style) and snake_case in Python.

The models live in one module per part of the spec (job, model_data, reward, algorithm, rollout,
trainer, infra, status; the algorithm's families, LoRA and the pod templates beside them); this
package re-exports them, so `from asyncrl.api.spec import X` names any of them.

Cross-field rules live in `model_validator`s *and* as CEL rules (`CelRule`) that each model
declares in `__cel_rules__`, beside the validators they restate; the CRD generator walks the models
to collect them, and the test suite evaluates both on the same objects so the two cannot drift apart.
"""

from __future__ import annotations

from asyncrl.api.spec.algorithm import (
    MOVED_FIELDS,
    OPOB_AGGREGATIONS,
    RETYPED_FIELDS,
    TB_ONLY,
    TB_UNUSED,
    AlgorithmSpec,
    OptimizerSpec,
    ReplaySpec,
    StalenessSpec,
)
from asyncrl.api.spec.base import (
    GROUP,
    CelRule,
    ImageRef,
    SpecModel,
    StatusModel,
    builtin_or_plugin,
    parse_quantity,
)
from asyncrl.api.spec.families import (
    BapoSpec,
    BehaviourCapSpec,
    DynamicSamplingSpec,
    M2Spec,
    SapoSpec,
    TbSpec,
    VcpoSpec,
)
from asyncrl.api.spec.infra import (
    ExternalRedis,
    LoggingSpec,
    ManagedRedis,
    MlflowSpec,
    RedisResources,
    RedisSpec,
    Resources,
    SecretKeyRef,
    StorageSpec,
    TensorBoardSpec,
    WandbKeyRef,
    WandbSpec,
)
from asyncrl.api.spec.job import (
    API_VERSION,
    COLLECTIVE_ENGINES,
    IMMUTABLE_FIELDS,
    JOB_NAME_MAX,
    JOB_NAME_PATTERN,
    KIND,
    LORA_SGLANG_MODULES_MESSAGE,
    LORA_TRANSPORT_MESSAGE,
    LORA_VLLM_RANK_MESSAGE,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    AsyncRLJob,
    AsyncRLJobSpec,
    ObjectMeta,
)
from asyncrl.api.spec.lora import ALL_LINEAR, ALL_LINEAR_ALONE, SGLANG_TARGET_MODULES, VLLM_MAX_LORA_RANKS, LoraSpec
from asyncrl.api.spec.model_data import (
    BUILTIN_SPLITS,
    SOURCE_NAME_PATTERN,
    DatasetSourceSpec,
    DatasetSpec,
    EvalDatasetSpec,
    EvalSourceSpec,
    EvaluationSpec,
    ModelSpec,
    NamedSource,
)
from asyncrl.api.spec.pod_template import RedisPodTemplate, RolloutPodTemplate, TrainerPodTemplate
from asyncrl.api.spec.reward import (
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_FIELDS,
    REWARDS,
    JudgeSpec,
    RewardDeploymentSpec,
    RewardServiceSpec,
    RewardSpec,
)
from asyncrl.api.spec.rollout import ENGINE_IMAGES, ENGINES, EPISODES, TOOLS, EpisodeLimits, RolloutSpec
from asyncrl.api.spec.status import (
    CONDITION_TYPES,
    PHASES,
    TERMINAL_PHASES,
    AsyncRLJobStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    EvaluationStatus,
    JobPhase,
    ProgressStatus,
    RecoveryStatus,
    RolloutStatus,
    StalenessStatus,
    TrainerStatus,
)
from asyncrl.api.spec.trainer import NCCL_DEBUG_LEVELS, NcclSettings, RdmaSettings, TrainerSpec

__all__ = [
    "ALL_LINEAR", "ALL_LINEAR_ALONE", "API_VERSION", "BUILTIN_SPLITS", "COLLECTIVE_ENGINES", "CONDITION_TYPES",
    "DEFAULT_JUDGE_TEMPLATE", "ENGINES", "ENGINE_IMAGES", "EPISODES",
    "GROUP", "IMMUTABLE_FIELDS", "JOB_NAME_MAX", "JOB_NAME_PATTERN",
    "JUDGE_FIELDS", "KIND", "LORA_SGLANG_MODULES_MESSAGE", "LORA_TRANSPORT_MESSAGE", "LORA_VLLM_RANK_MESSAGE",
    "MOVED_FIELDS", "NCCL_DEBUG_LEVELS", "OPOB_AGGREGATIONS", "PHASES", "PLURAL", "RETYPED_FIELDS", "REWARDS",
    "SGLANG_TARGET_MODULES", "SHORT_NAMES", "SINGULAR", "SOURCE_NAME_PATTERN", "TB_ONLY", "TB_UNUSED",
    "TERMINAL_PHASES", "TOOLS", "VERSION", "VLLM_MAX_LORA_RANKS",
    "AlgorithmSpec", "AsyncRLJob", "AsyncRLJobSpec", "AsyncRLJobStatus", "BapoSpec", "BehaviourCapSpec", "CelRule",
    "Condition", "ConditionStatus", "ConditionType", "DatasetSourceSpec", "DatasetSpec", "DynamicSamplingSpec",
    "EpisodeLimits", "EvalDatasetSpec", "EvalSourceSpec", "EvaluationSpec", "EvaluationStatus", "ExternalRedis",
    "ImageRef", "JobPhase", "JudgeSpec", "LoggingSpec", "LoraSpec", "M2Spec", "ManagedRedis", "MlflowSpec",
    "ModelSpec", "NamedSource", "NcclSettings", "ObjectMeta", "OptimizerSpec", "ProgressStatus", "RdmaSettings",
    "RecoveryStatus", "RedisPodTemplate", "RedisResources", "RedisSpec", "ReplaySpec", "Resources",
    "RewardDeploymentSpec", "RewardServiceSpec", "RewardSpec", "RolloutPodTemplate", "RolloutSpec", "RolloutStatus",
    "SapoSpec", "SecretKeyRef", "SpecModel", "StalenessSpec", "StalenessStatus", "StatusModel", "StorageSpec",
    "TbSpec", "TensorBoardSpec", "TrainerPodTemplate", "TrainerSpec", "TrainerStatus", "VcpoSpec", "WandbKeyRef",
    "WandbSpec", "builtin_or_plugin", "parse_quantity",
]
