"""The job's status: the observed state the operator writes (phase, conditions, the trainer's and
rollout's progress, staleness, evaluation, recovery), mirrored from the trainer's /status."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from asyncrl.api.spec.base import StatusModel
from asyncrl.api.status_report import RecoveryReport

JobPhase = Literal["Pending", "Initializing", "Running", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[JobPhase, ...] = get_args(JobPhase)
TERMINAL_PHASES: tuple[JobPhase, ...] = ("Succeeded", "Failed")
ConditionType = Literal["RolloutReady", "TrainerReady", "StreamReady", "WeightsSynced", "Degraded", "Complete",
                        "Failed"]
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: ConditionType
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class TrainerStatus(StatusModel):
    """Trainer progress mirrored from its status endpoint."""

    step: int = 0
    policy_version: int = 0
    last_checkpoint: str | None = None


class RolloutStatus(StatusModel):
    """Rollout replicas and the oldest weight version they serve."""

    desired: int = 0
    ready: int = 0
    summary: str = "0/0"
    """ready/desired, for the printer column."""
    selector: str = ""
    """Label selector of the rollout pods (scale subresource)."""
    min_weight_version: int | None = None


class StalenessStatus(StatusModel):
    """Version lag of trained tokens (eta = limit)."""

    mean: float = 0.0
    max: int = 0
    limit: int = 0
    dropped: int = 0


class ProgressStatus(StatusModel):
    """How far along the job is and how well it is doing."""

    percent: float = 0.0
    reward_mean: float | None = None
    tokens_per_second: float = 0.0


class RecoveryStatus(StatusModel, RecoveryReport):
    """What the job recovered from, in totals since it started (the trainer's report: /status)."""


class EvaluationStatus(StatusModel):
    """The newest held-out evaluation, mirrored from the trainer's /status."""

    policy_version: int | None = None
    reward_mean: float | None = None
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    """pass@k with k = evaluation.samplesPerPrompt (only when k > 1)."""
    k: int = 1
    summary: str = ""
    """pass@1 and its version, e.g. "0.42@v14", for the printer column."""


class AsyncRLJobStatus(StatusModel):
    """Observed state of the job, written by the operator."""

    observed_generation: int | None = None
    phase: JobPhase = "Pending"
    reason: str = ""
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    trainer: TrainerStatus = Field(default_factory=TrainerStatus)
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    staleness: StalenessStatus = Field(default_factory=StalenessStatus)
    progress: ProgressStatus = Field(default_factory=ProgressStatus)
    evaluation: EvaluationStatus | None = None
    """Set once the first held-out evaluation is done (spec.evaluation)."""
    recovery: RecoveryStatus | None = None
    """Set from the trainer's first report on."""
    last_step: dict[str, float] | None = None
    """Every figure of the trainer's last step, by its name in metrics.jsonl (the trainer's /status
    `last_step`; a figure an objective does not have is absent), e.g. `kubectl get asyncrljob NAME -o
    jsonpath='{.status.lastStep.clip_fraction}'`."""
    status_url: str | None = Field(default=None, alias="statusURL")
