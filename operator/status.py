"""Pure status computation: what the cluster looks like in, the AsyncRLJob `.status` out.

Honest status is the product here: phase says where the job is in its lifecycle (Pending ->
Initializing -> Running -> Succeeded | Failed, or Suspended), conditions say what is ready right
now, and `reason`/`message` say why a job is not running, down to the pod's own reason
(ImagePullBackOff, Unschedulable, CrashLoopBackOff, OOMKilled). Terminal phases are sticky.
Everything here is a function of its inputs (the clock is a parameter), so tests need no cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from asyncrl.spec import CONDITION_TYPES, TERMINAL_PHASES
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
class JobView:
    """The parts of the job object the status depends on."""

    name: str
    namespace: str
    generation: int | None
    created: datetime
    suspend: bool
    rollout_replicas: int
    trainer_replicas: int
    external_redis: bool
    startup_deadline_seconds: int
    max_steps: int
    staleness_limit: int
    status_url: str
    rollout_selector: str


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
            return PodProblem(name, waiting["reason"], f"container {cs.get('name')}: {waiting.get('message', '')}".rstrip(": "))
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return PodProblem(name, "Unschedulable", cond.get("message", ""))
    if status.get("phase") == "Failed":
        return PodProblem(name, status.get("reason") or "PodFailed", status.get("message", ""))
    return None


def pod_problems(pods: list[dict[str, Any]]) -> list[PodProblem]:
    return [p for p in (pod_problem(pod) for pod in sorted(pods, key=lambda x: x.get("metadata", {}).get("name", ""))) if p]


# ----------------------------------------------------------------------------------- conditions


def _condition(prev: dict[str, dict[str, Any]], ctype: str, status: str, reason: str, message: str,
               now: datetime, generation: int | None) -> dict[str, Any]:
    old = prev.get(ctype)
    changed = old is None or old.get("status") != status
    out = {"type": ctype, "status": status, "reason": reason, "message": _truncate(message),
           "lastTransitionTime": fmt_time(now) if changed else old.get("lastTransitionTime") or fmt_time(now)}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def _ready(ready: int | None, desired: int) -> tuple[str, str, str]:
    if ready is None:
        return "False", "NotCreated", "not created yet"
    if desired == 0:
        return "False", "ScaledToZero", "0 replicas requested"
    if ready >= desired:
        return "True", "Ready", f"{ready}/{desired} ready"
    return "False", "NotReady", f"{ready}/{desired} ready"


def _weights(report: TrainerReport | None) -> tuple[str, str, str]:
    if report is None:
        return "Unknown", "NoReport", "the trainer's status endpoint has not answered yet"
    versions = [e.weight_version for e in report.rollout]
    if not versions:
        return "Unknown", "NoEngines", "no rollout engine has registered"
    known = [v for v in versions if v is not None]
    if len(known) == len(versions) and min(known) >= report.policy_version:
        return "True", "Synced", f"all {len(versions)} engines serve version {report.policy_version}"
    lowest = min(known) if known else None
    return "False", "Lagging", f"oldest engine weights: {lowest}, trainer: {report.policy_version}"


# ----------------------------------------------------------------------------------- the status


def compute_status(job: JobView, prev: dict[str, Any], obs: Observed, now: datetime,
                   *, invalid: str | None = None) -> dict[str, Any]:
    """The new `.status` (camelCase, as written to the API) from the previous one and observations."""
    prev = dict(prev or {})
    prev_phase = prev.get("phase") or "Pending"
    prev_conds = {c.get("type"): c for c in prev.get("conditions") or [] if isinstance(c, dict)}
    stopped_by_user = job.suspend
    rollout_desired = 0 if stopped_by_user else job.rollout_replicas
    trainer_desired = 0 if stopped_by_user else job.trainer_replicas
    report = obs.report

    rollout = _ready(obs.rollout_ready, rollout_desired)
    trainer = _ready(obs.trainer_ready, trainer_desired)
    if job.external_redis:
        stream = ("True", "External", "external Redis (from the job's Secret)")
    else:
        stream = _ready(obs.redis_ready, 1)
    weights = _weights(report)

    start = parse_time(prev.get("startTime")) or now
    completion = prev.get("completionTime")
    problem = obs.problems[0] if obs.problems else None

    # ---- phase, reason, message
    if prev_phase in TERMINAL_PHASES:
        phase, reason, message = prev_phase, prev.get("reason", ""), prev.get("message", "")
    elif invalid is not None:
        phase, reason, message = "Failed", "InvalidSpec", invalid
    elif report is not None and report.phase == "Succeeded":
        phase, reason = "Succeeded", "TrainingComplete"
        message = f"trained {report.step} steps (policy version {report.policy_version})"
    elif report is not None and report.phase == "Failed":
        phase, reason, message = "Failed", "TrainerFailed", report.message or "the trainer reported a failure"
    elif job.suspend:
        phase, reason, message = "Suspended", "Suspended", "rollout and trainer scaled to zero; Redis and volumes kept"
    else:
        if prev_phase == "Suspended":
            start = now  # resumed: the startup deadline counts again from here
        all_ready = rollout[0] == "True" and trainer[0] == "True" and stream[0] == "True"
        if prev_phase == "Running" or all_ready:
            phase = "Running"
            if all_ready:
                reason, message = "Running", "rollout, trainer and Redis are ready"
            else:
                reason = problem.reason if problem else "Degraded"
                message = problem.describe() if problem else _not_ready_message(rollout, trainer, stream)
        elif now - start > timedelta(seconds=job.startup_deadline_seconds):
            phase = "Failed"
            reason = "StartupDeadlineExceeded"
            detail = problem.describe() if problem else _not_ready_message(rollout, trainer, stream)
            message = f"not running {job.startup_deadline_seconds}s after start: {detail}"
        elif obs.rollout_ready is None and obs.trainer_ready is None:
            phase, reason, message = "Pending", "Creating", "creating the job's objects"
        else:
            phase = "Initializing"
            reason = problem.reason if problem else "WaitingForPods"
            message = problem.describe() if problem else _not_ready_message(rollout, trainer, stream)

    if phase in TERMINAL_PHASES and not completion:
        completion = fmt_time(now)

    conds = [
        _condition(prev_conds, "RolloutReady", *rollout, now, job.generation),
        _condition(prev_conds, "TrainerReady", *trainer, now, job.generation),
        _condition(prev_conds, "StreamReady", *stream, now, job.generation),
        _condition(prev_conds, "WeightsSynced", *weights, now, job.generation),
        _condition(prev_conds, "Complete", *(("True", reason, message) if phase == "Succeeded"
                                              else ("False", "NotComplete", "")), now, job.generation),
        _condition(prev_conds, "Failed", *(("True", reason, message) if phase == "Failed"
                                            else ("False", "NotFailed", "")), now, job.generation),
    ]
    assert [c["type"] for c in conds] == list(CONDITION_TYPES)

    ready = obs.rollout_ready or 0
    status: dict[str, Any] = {
        "observedGeneration": job.generation,
        "phase": phase,
        "reason": reason,
        "message": _truncate(message),
        "conditions": conds,
        "startTime": fmt_time(start),
        "rollout": {"desired": rollout_desired, "ready": ready, "summary": f"{ready}/{rollout_desired}",
                    "selector": job.rollout_selector},
        "statusURL": job.status_url,
    }
    if completion:
        status["completionTime"] = completion
    for key in ("trainer", "staleness", "progress"):
        if key in prev:
            status[key] = prev[key]
    if "minWeightVersion" in (prev.get("rollout") or {}):
        status["rollout"]["minWeightVersion"] = prev["rollout"]["minWeightVersion"]
    if report is not None:
        from asyncrl.operator.mirror import report_fields

        mirrored = report_fields(report, max_steps=job.max_steps, staleness_limit=job.staleness_limit)
        status["rollout"].update(mirrored.pop("rollout"))
        status.update(mirrored)
    status.setdefault("staleness", {"mean": 0.0, "max": 0, "limit": job.staleness_limit, "dropped": 0})
    return status


def _not_ready_message(*parts: tuple[str, str, str]) -> str:
    names = ("rollout", "trainer", "redis")
    waiting = [f"{n} {m}" for n, (s, _, m) in zip(names, parts) if s != "True"]
    return "waiting for " + ", ".join(waiting) if waiting else "waiting"


def ttl_expired(status: dict[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    """Whether a finished job has outlived ttlSecondsAfterFinished."""
    if ttl_seconds is None or status.get("phase") not in TERMINAL_PHASES:
        return False
    done = parse_time(status.get("completionTime"))
    return done is not None and now - done >= timedelta(seconds=ttl_seconds)
