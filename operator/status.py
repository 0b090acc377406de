"""Pure status computation: what the cluster looks like in, the AsyncRLJob `.status` out.

Honest status is the product here: phase says where the job is in its lifecycle (Pending ->
Initializing -> Running -> Succeeded | Failed, or Suspended), conditions say what is ready right
now, and `reason`/`message` say why a job is not running, down to the pod's own reason
(ImagePullBackOff, Unschedulable, CrashLoopBackOff, OOMKilled). Terminal phases are sticky.
Everything here is a function of its inputs (the clock is a parameter), so tests need no cluster.

The status is built as `asyncrl.spec.AsyncRLJobStatus`, the model the CRD's status schema is
generated from, and written as its camelCase dump: one definition of what `.status` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

from pydantic import ValidationError

from asyncrl.operator import builders as B
from asyncrl.operator.mirror import mirror_report
from asyncrl.spec import (
    CONDITION_TYPES,
    TERMINAL_PHASES,
    AsyncRLJobSpec,
    AsyncRLJobStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    JobPhase,
    RolloutStatus,
    StalenessStatus,
)
from asyncrl.status_report import TrainerReport

# Container waiting reasons that mean "this will not start by itself".
BLOCKING_WAITING_REASONS = (
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
)
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class PodProblem:
    """Why one pod is not running."""

    pod: str
    reason: str
    message: str = ""

    def describe(self) -> str:
        return f"pod {self.pod}: {self.reason}" + (f": {self.message}" if self.message else "")


@dataclass
class Observed:
    """What the operator saw of the job's children (None = the object does not exist yet)."""

    rollout_ready: int | None = None
    trainer_ready: int | None = None
    redis_ready: int | None = None
    """Ready managed-Redis pods; ignored for an external Redis."""
    problems: list[PodProblem] = field(default_factory=list)
    report: TrainerReport | None = None
    report_error: str | None = None


@dataclass(frozen=True)
class JobRef:
    """Which object a status is for. The spec model does not carry this: the namespace the object
    lives in and the generation the status describes come from its live metadata, and the name is
    needed even when the spec did not validate."""

    name: str
    namespace: str
    generation: int | None = None


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def fmt_time(t: datetime) -> str:
    """RFC 3339 in UTC with seconds precision, as Kubernetes writes times."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _truncate(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


# ----------------------------------------------------------------------------------- pods


def pod_problem(pod: dict[str, Any]) -> PodProblem | None:
    """The most specific reason a pod is stuck or failing, or None if it looks healthy or young."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    statuses = list(status.get("initContainerStatuses") or []) + list(status.get("containerStatuses") or [])
    for cs in statuses:  # OOMKilled first: CrashLoopBackOff is often just its consequence
        for state_key in ("state", "lastState"):
            term = (cs.get(state_key) or {}).get("terminated") or {}
            if term.get("reason") == "OOMKilled":
                return PodProblem(name, "OOMKilled",
                                  f"container {cs.get('name')} ran out of memory; raise its memory limit")
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in BLOCKING_WAITING_REASONS:
            detail = f"container {cs.get('name')}: {waiting.get('message', '')}".rstrip(": ")
            return PodProblem(name, waiting["reason"], detail)
    for cond in status.get("conditions") or []:
        if (cond.get("type"), cond.get("status"), cond.get("reason")) == ("PodScheduled", "False", "Unschedulable"):
            return PodProblem(name, "Unschedulable", cond.get("message", ""))
    if status.get("phase") == "Failed":
        return PodProblem(name, status.get("reason") or "PodFailed", status.get("message", ""))
    return None


def pod_problems(pods: list[dict[str, Any]]) -> list[PodProblem]:
    by_name = sorted(pods, key=lambda pod: pod.get("metadata", {}).get("name", ""))
    return [p for p in map(pod_problem, by_name) if p]


# ----------------------------------------------------------------------------------- readiness


class Check(NamedTuple):
    """One condition's verdict, before it gets its type and transition time."""

    status: ConditionStatus
    reason: str
    message: str


EXTERNAL_REDIS = Check("True", "External", "external Redis (from the job's Secret)")


@dataclass(frozen=True)
class Readiness:
    """The readiness conditions, from the observed children and the trainer's report."""

    rollout: Check
    trainer: Check
    stream: Check
    weights: Check

    @property
    def all_ready(self) -> bool:
        return all(c.status == "True" for c in (self.rollout, self.trainer, self.stream))

    def waiting(self) -> str:
        """What the job still waits for, e.g. `waiting for rollout 1/4 ready, redis not created yet`."""
        parts = (("rollout", self.rollout), ("trainer", self.trainer), ("redis", self.stream))
        waiting = [f"{name} {check.message}" for name, check in parts if check.status != "True"]
        return "waiting for " + ", ".join(waiting) if waiting else "waiting"


def _desired(spec: AsyncRLJobSpec | None) -> tuple[int, int]:
    """Rollout and trainer replicas the job should have now (none while suspended or invalid)."""
    if spec is None or spec.suspend:
        return 0, 0
    return spec.rollout.replicas, spec.trainer.replicas


def _ready(ready: int | None, desired: int) -> Check:
    if ready is None:
        return Check("False", "NotCreated", "not created yet")
    if desired == 0:
        return Check("False", "ScaledToZero", "0 replicas requested")
    if ready >= desired:
        return Check("True", "Ready", f"{ready}/{desired} ready")
    return Check("False", "NotReady", f"{ready}/{desired} ready")


def _weights(report: TrainerReport | None) -> Check:
    if report is None:
        return Check("Unknown", "NoReport", "the trainer's status endpoint has not answered yet")
    versions = [e.weight_version for e in report.rollout]
    if not versions:
        return Check("Unknown", "NoEngines", "no rollout engine has registered")
    known = [v for v in versions if v is not None]
    if len(known) == len(versions) and min(known) >= report.policy_version:
        return Check("True", "Synced", f"all {len(versions)} engines serve version {report.policy_version}")
    lowest = min(known) if known else None
    return Check("False", "Lagging", f"oldest engine weights: {lowest}, trainer: {report.policy_version}")


def _readiness(spec: AsyncRLJobSpec | None, obs: Observed) -> Readiness:
    rollout_desired, trainer_desired = _desired(spec)
    managed_redis = spec is not None and spec.redis.mode == "managed"
    return Readiness(
        rollout=_ready(obs.rollout_ready, rollout_desired),
        trainer=_ready(obs.trainer_ready, trainer_desired),
        # Without a valid spec nothing was created: there is no Redis of ours to wait for either.
        stream=_ready(obs.redis_ready, 1) if managed_redis else EXTERNAL_REDIS,
        weights=_weights(obs.report),
    )


# ----------------------------------------------------------------------------------- phase


class Verdict(NamedTuple):
    """Where the job is in its lifecycle, and why."""

    phase: JobPhase
    reason: str
    message: str


def _settled(spec: AsyncRLJobSpec | None, before: AsyncRLJobStatus, report: TrainerReport | None,
             invalid: str | None) -> Verdict | None:
    """The phase when no child can change it: a terminal phase (sticky), an invalid spec, the
    trainer's own outcome, suspension. None: the children decide (`_progressing`)."""
    if before.phase in TERMINAL_PHASES:
        return Verdict(before.phase, before.reason, before.message)
    if spec is None or invalid is not None:
        return Verdict("Failed", "InvalidSpec", invalid or "invalid spec")
    if report is not None and report.phase == "Succeeded":
        return Verdict("Succeeded", "TrainingComplete",
                       f"trained {report.step} steps (policy version {report.policy_version})")
    if report is not None and report.phase == "Failed":
        return Verdict("Failed", "TrainerFailed", report.message or "the trainer reported a failure")
    if spec.suspend:
        return Verdict("Suspended", "Suspended", "rollout and trainer scaled to zero; Redis and volumes kept")
    return None


def _progressing(spec: AsyncRLJobSpec, prev_phase: JobPhase, obs: Observed, ready: Readiness, start: datetime,
                 now: datetime) -> Verdict:
    """Pending -> Initializing -> Running, or Failed when the startup deadline passes first."""
    problem = obs.problems[0] if obs.problems else None
    why = problem.describe() if problem else ready.waiting()
    if ready.all_ready:
        return Verdict("Running", "Running", "rollout, trainer and Redis are ready")
    if prev_phase == "Running":  # losing a pod does not go back to Initializing; the reason says why
        return Verdict("Running", problem.reason if problem else "Degraded", why)
    deadline = spec.startup_deadline_seconds
    if now - start > timedelta(seconds=deadline):
        return Verdict("Failed", "StartupDeadlineExceeded", f"not running {deadline}s after start: {why}")
    if obs.rollout_ready is None and obs.trainer_ready is None:
        return Verdict("Pending", "Creating", "creating the job's objects")
    return Verdict("Initializing", problem.reason if problem else "WaitingForPods", why)


# ----------------------------------------------------------------------------------- status parts


def _condition(ctype: ConditionType, check: Check, old: Condition | None, now: datetime,
               generation: int | None) -> Condition:
    """`lastTransitionTime` moves only when the condition's status does."""
    if old is not None and old.status == check.status and old.last_transition_time:
        since = old.last_transition_time
    else:
        since = fmt_time(now)
    return Condition(type=ctype, status=check.status, reason=check.reason, message=_truncate(check.message),
                     last_transition_time=since, observed_generation=generation)


def _conditions(before: AsyncRLJobStatus, ready: Readiness, verdict: Verdict, now: datetime,
                generation: int | None) -> list[Condition]:
    outcome = Check("True", verdict.reason, verdict.message)
    checks: dict[ConditionType, Check] = {
        "RolloutReady": ready.rollout,
        "TrainerReady": ready.trainer,
        "StreamReady": ready.stream,
        "WeightsSynced": ready.weights,
        "Complete": outcome if verdict.phase == "Succeeded" else Check("False", "NotComplete", ""),
        "Failed": outcome if verdict.phase == "Failed" else Check("False", "NotFailed", ""),
    }
    previous = {c.type: c for c in before.conditions}
    return [_condition(ctype, checks[ctype], previous.get(ctype), now, generation) for ctype in CONDITION_TYPES]


def _rollout(ref: JobRef, spec: AsyncRLJobSpec | None, obs: Observed) -> RolloutStatus:
    desired, _ = _desired(spec)
    ready = obs.rollout_ready or 0
    return RolloutStatus(desired=desired, ready=ready, summary=f"{ready}/{desired}",
                         selector=B.rollout_selector(ref.name))


def _figures(status: AsyncRLJobStatus, before: AsyncRLJobStatus, report: TrainerReport | None,
             spec: AsyncRLJobSpec | None) -> None:
    """trainer, staleness, progress and rollout.minWeightVersion: from this pass's report, else the
    last ones written. trainer and progress stay absent until the trainer has reported."""
    kept = before.model_fields_set
    if "trainer" in kept:
        status.trainer = before.trainer
    if "staleness" in kept:
        status.staleness = before.staleness
    if "progress" in kept:
        status.progress = before.progress
    if before.rollout.min_weight_version is not None:
        status.rollout.min_weight_version = before.rollout.min_weight_version
    if report is not None and spec is not None:
        mirror_report(status, report, spec)
    if "staleness" not in status.model_fields_set:
        eta = spec.staleness.max_head_offpolicyness if spec is not None else 0
        status.staleness = StalenessStatus(mean=0.0, max=0, limit=eta, dropped=0)


def previous_status(prev: Mapping[str, Any] | None) -> AsyncRLJobStatus:
    """The status as last written. One this operator cannot read (edited by hand, or written by a
    newer version) is treated as absent rather than failing every pass."""
    try:
        return AsyncRLJobStatus.model_validate(prev or {})
    except ValidationError:
        return AsyncRLJobStatus()


def wire(status: AsyncRLJobStatus) -> dict[str, Any]:
    """The camelCase `.status` as written to the API server. Only fields the operator set appear
    (exclude_unset): model defaults such as `trainer: {step: 0}` are not written."""
    return status.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json")


# ----------------------------------------------------------------------------------- the status


def compute_status(ref: JobRef, spec: AsyncRLJobSpec | None, prev: Mapping[str, Any] | None, obs: Observed,
                   now: datetime, *, invalid: str | None = None) -> dict[str, Any]:
    """The new `.status` (camelCase, as written to the API) from the previous one and observations.

    `spec` is None when the object did not validate; `invalid` then says why.
    """
    before = previous_status(prev)
    ready = _readiness(spec, obs)

    # Phase: settled by the past, the spec or the trainer; otherwise by how far the children are.
    start = parse_time(before.start_time) or now
    verdict = _settled(spec, before, obs.report, invalid)
    if verdict is None:
        assert spec is not None  # _settled decides every job without a valid spec
        if before.phase == "Suspended":
            start = now  # resumed: the startup deadline counts again from here
        verdict = _progressing(spec, before.phase, obs, ready, start, now)
    completion = before.completion_time or None
    if verdict.phase in TERMINAL_PHASES and not completion:
        completion = fmt_time(now)

    status = AsyncRLJobStatus(
        observed_generation=ref.generation,
        phase=verdict.phase,
        reason=verdict.reason,
        message=_truncate(verdict.message),
        conditions=_conditions(before, ready, verdict, now, ref.generation),
        start_time=fmt_time(start),
        completion_time=completion,
        rollout=_rollout(ref, spec, obs),
        # status_url by its alias, the name type checkers know it by (the model accepts both)
        statusURL=B.status_url(ref.name, ref.namespace, spec.trainer.status_port) if spec is not None else "",
    )
    _figures(status, before, obs.report, spec)
    return wire(status)


def ttl_expired(status: Mapping[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    """Whether a finished job has outlived ttlSecondsAfterFinished."""
    if ttl_seconds is None or status.get("phase") not in TERMINAL_PHASES:
        return False
    done = parse_time(status.get("completionTime"))
    return done is not None and now - done >= timedelta(seconds=ttl_seconds)
