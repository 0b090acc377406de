"""Pure status computation: what the cluster looks like in, the AsyncRLJob `.status` out.

Honest status is the product here: phase says where the job is in its lifecycle (Pending ->
Initializing -> Running -> Succeeded | Failed, or Suspended), conditions say what is ready right
now, and `reason`/`message` say why a job is not running, down to the pod's own reason
(ImagePullBackOff, Unschedulable, CrashLoopBackOff, OOMKilled). Terminal phases are sticky.
Everything here is a function of its inputs (the clock is a parameter), so tests need no cluster.

How a job ends, in the order `compute_status` asks:
1. a terminal phase already written stays (sticky);
2. an invalid spec: Failed InvalidSpec;
3. the trainer's durable outcome record (asyncrl.api.outcome, read from Redis): its phase and reason;
4. the trainer's live /status saying Succeeded/Failed: its reason (else TrainingComplete / TrainerFailed);
5. suspended: Suspended (no pod rule applies to a job that has no pods);
6. the trainer's containers (`trainer_failure`): a last exit code 78 fails at once
   (ConfigurationError, the termination message), more than `spec.trainer.backoffLimit` restarts
   of one container fail it (BackoffLimitExceeded);
7. `spec.activeDeadlineSeconds` after startTime: DeadlineExceeded;
8. otherwise the children decide: Pending, Initializing, Running, or StartupDeadlineExceeded; a job
   whose pods Kueue still holds (spec.queueName) is Pending/Queued, and its deadlines count from
   admission.
A crash-looping rollout (or trainer, below its backoff limit) pod only sets the `Degraded` condition,
and so does a trainer that reports it is waiting out an outage of Redis or an engine (its /status
`degraded`, `dependency_outage`): the job rides it out, and the condition says what and since when.

The status is built as `asyncrl.api.spec.AsyncRLJobStatus`, the model the CRD's status schema is
generated from, and written as its camelCase dump: one definition of what `.status` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

from pydantic import ValidationError

from asyncrl.api.outcome import EXIT_CONFIG_ERROR, TrainerOutcome, is_config_error
from asyncrl.api.spec import (
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
from asyncrl.api.status_report import TrainerReport
from asyncrl.infra.health import REASONS, dependency_name
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.mirror import mirror_outcome, mirror_report

# Container waiting reasons that mean "this will not start by itself".
BLOCKING_WAITING_REASONS = (
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
)
MAX_MESSAGE = 1024
QUEUED = "Queued"
"""Reason of a pod Kueue holds (its admission scheduling gate), and of a job not yet admitted: Pending,
with no startup deadline and no startTime until every pod is released (spec.queueName)."""


@dataclass(frozen=True)
class PodProblem:
    """Why one pod is not running (or, `kind` deployment, why a workload cannot create its pods)."""

    pod: str
    reason: str
    message: str = ""
    kind: str = "pod"

    def describe(self) -> str:
        return f"{self.kind} {self.pod}: {self.reason}" + (f": {self.message}" if self.message else "")


@dataclass(frozen=True)
class ContainerRun:
    """One container of one of the job's pods, as the kubelet reports it (`containerStatuses[]`)."""

    pod: str
    component: str
    """The pod's `app.kubernetes.io/component` label: trainer, rollout, redis."""
    container: str
    restarts: int = 0
    ready: bool = False
    waiting_reason: str = ""
    exit_code: int | None = None
    """Of the last termination: `state.terminated` (dead now), else `lastState.terminated`."""
    exit_reason: str = ""
    exit_message: str = ""
    """The termination message (what the process wrote to /dev/termination-log)."""

    @property
    def crash_looping(self) -> bool:
        """Restarting rather than running: in CrashLoopBackOff, or restarted and not ready (again)."""
        return self.waiting_reason == "CrashLoopBackOff" or (self.restarts > 0 and not self.ready)

    def last_exit(self) -> str:
        """`last exit code 1 (Error): <termination message>`, or "" when it never terminated."""
        if self.exit_code is None:
            return ""
        text = f"last exit code {self.exit_code}" + (f" ({self.exit_reason})" if self.exit_reason else "")
        return text + (f": {self.exit_message.strip()}" if self.exit_message.strip() else "")

    def describe(self) -> str:
        what = f"pod {self.pod} container {self.container}"
        if self.waiting_reason:
            what += f": {self.waiting_reason}"
        what += f", {self.restarts} restart{'s' if self.restarts != 1 else ''}"
        last = self.last_exit()
        return what + (f", {last}" if last else "")


def container_runs(pods: list[dict[str, Any]]) -> list[ContainerRun]:
    """Every (non-init) container of `pods`, sorted by pod and container name."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        component = (meta.get("labels") or {}).get(N.LABEL_COMPONENT, "")
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            state, last = cs.get("state") or {}, cs.get("lastState") or {}
            term = state.get("terminated") or last.get("terminated") or {}
            code = term.get("exitCode")
            out.append(ContainerRun(
                pod=meta.get("name", "?"), component=component, container=cs.get("name", "?"),
                restarts=int(cs.get("restartCount") or 0), ready=bool(cs.get("ready")),
                waiting_reason=(state.get("waiting") or {}).get("reason") or "",
                exit_code=int(code) if isinstance(code, int) else None,
                exit_reason=term.get("reason") or "", exit_message=term.get("message") or ""))
    return sorted(out, key=lambda c: (c.pod, c.container))


@dataclass
class Observed:
    """What the operator saw of the job's children (None = the object does not exist yet)."""

    rollout_ready: int | None = None
    trainer_ready: int | None = None
    redis_ready: int | None = None
    """Ready managed-Redis pods; ignored for an external Redis."""
    problems: list[PodProblem] = field(default_factory=list)
    containers: list[ContainerRun] = field(default_factory=list)
    """The containers of the job's pods (restarts and last terminations: `container_runs`)."""
    outcome: TrainerOutcome | None = None
    """The trainer's durable outcome record (Redis), once training has ended."""
    outcome_error: str | None = None
    """Why the outcome record could not be read (Redis unreachable, its Secret missing)."""
    report: TrainerReport | None = None
    conflict: str | None = None
    """A child's name is held by an object that is not the job's (kube.ChildConflict): the job waits."""
    report_error: str | None = None
    """Why the trainer's /status could not be read (shown in the WeightsSynced condition)."""


@dataclass(frozen=True)
class JobRef:
    """Which object a status is for. The spec model does not carry this: the namespace the object
    lives in and the generation the status describes come from its live metadata, and the name is
    needed even when the spec did not validate."""

    name: str
    namespace: str
    generation: int | None = None


CHILD_CONFLICT = "ChildConflict"
"""The reason of a job held because an object of a child's name is not the job's."""


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
    gates = {g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []}
    if N.KUEUE_ADMISSION_GATE in gates:
        return PodProblem(name, QUEUED, "held by Kueue until its queue admits the workload (spec.queueName)")
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


def queued(obs: Observed) -> bool:
    """Whether Kueue still holds one of the job's pods (its admission scheduling gate)."""
    return any(p.reason == QUEUED for p in obs.problems)


FAILED_CREATE = "FailedCreate"


def workload_problems(children: list[dict[str, Any]]) -> list[PodProblem]:
    """Deployments that cannot create their pods (a ResourceQuota, an admission webhook or policy that
    refuses them): the ReplicaSet controller's `ReplicaFailure` condition, which the Deployment
    controller copies onto the Deployment with the apiserver's refusal as its message. Without it
    the job would wait in Initializing with no pod to say why."""
    out = []
    for child in children:
        if child.get("kind") != "Deployment":
            continue
        for cond in (child.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                out.append(PodProblem(child.get("metadata", {}).get("name", "?"), cond.get("reason") or FAILED_CREATE,
                                      cond.get("message", ""), kind="deployment"))
    return out


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
    degraded: Check
    outage: Check | None = None
    """Why the trainer does not train though every pod is up: an outage it waits out
    (`dependency_outage`), else a stall (`stall`); also in `degraded`."""

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


def _weights(report: TrainerReport | None, report_error: str | None = None,
             outcome_error: str | None = None) -> Check:
    if report is None:  # (say why: the operator's own view of the trainer is the only diagnostic left)
        reasons = [f"its status endpoint: {report_error}" if report_error else "",
                   f"its outcome record: {outcome_error}" if outcome_error else ""]
        said = "; ".join(r for r in reasons if r)
        return Check("Unknown", "NoReport", f"the trainer could not be read ({_truncate(said)})" if said
                     else "the trainer's status endpoint has not answered yet")
    versions = [e.weight_version for e in report.rollout]
    if not versions:
        return Check("Unknown", "NoEngines", "no rollout engine has registered")
    known = [v for v in versions if v is not None]
    if len(known) == len(versions) and min(known) >= report.policy_version:
        return Check("True", "Synced", f"all {len(versions)} engines serve version {report.policy_version}")
    lowest = min(known) if known else None
    return Check("False", "Lagging", f"oldest engine weights: {lowest}, trainer: {report.policy_version}")


NOT_DEGRADED = Check("False", "Healthy",
                     "no rollout or trainer container is crash-looping and the trainer reaches its dependencies")


def crash_loop(containers: list[ContainerRun]) -> Check | None:
    """A rollout or trainer container crash-loops (the job goes on; the trainer's backoffLimit is
    what fails it), with the pod's own reason: OOMKilled when the kernel killed it, else
    CrashLoopBackOff, else the last termination's reason. None: none does."""
    looping = [c for c in containers if c.component in ("rollout", "trainer") and c.crash_looping]
    if not looping:
        return None
    first = looping[0]
    if first.exit_reason == "OOMKilled":
        reason = "OOMKilled"
    else:
        reason = first.waiting_reason or first.exit_reason or "Restarting"
    more = f" (and {len(looping) - 1} more)" if len(looping) > 1 else ""
    return Check("True", reason, f"{first.component} {first.describe()}{more}")


def _epoch(seconds: float) -> str:
    return fmt_time(datetime.fromtimestamp(seconds, timezone.utc))


def dependency_outage(report: TrainerReport | None) -> Check | None:
    """The trainer is waiting out an outage (its report's `degraded`): RedisUnavailable or
    EngineUnavailable, and a message naming each unreachable target, since when (a time, not a
    duration: the message, and so the status, stays the same from one pass to the next while the
    outage lasts), the last error and how long the trainer keeps waiting. None: nothing is down,
    or no report (an unreachable trainer says nothing about its dependencies)."""
    degraded = report.degraded if report is not None else None
    if degraded is None or not degraded.status:
        return None
    parts = []
    for o in degraded.outages:
        text = f"{dependency_name(o.dependency)} {o.target} unreachable since {_epoch(o.since)}"
        text += f" ({o.last_error})" if o.last_error else ""
        parts.append(text + (f", retrying for up to {o.window_s:.0f}s" if o.window_s else ""))
    if not parts:  # a report with no outage listed: its own words
        parts.append(degraded.message or "a dependency is unreachable")
    first = degraded.outages[0].dependency if degraded.outages else ""
    reason = degraded.reason or REASONS.get(first, "DependencyUnavailable")
    return Check("True", reason, "the trainer is waiting: " + "; ".join(parts))


def stall(report: TrainerReport | None) -> Check | None:
    """The trainer accepts no group and says why (its report's `stalled`: RewardFailures,
    EpisodeFailures, GenerationFailures, EngineUnreachable, TooStale, NoGroupsProduced), with the
    counts and the last error; since when is a time, so the message stays the same from one pass to
    the next while the cause and its count do. None: not stalled, or no report."""
    stalled = report.stalled if report is not None else None
    if stalled is None or not stalled.reason:
        return None
    return Check("True", stalled.reason, f"no group accepted for training since {_epoch(stalled.since)}: "
                                         f"{stalled.message}")


def degraded(containers: list[ContainerRun], report: TrainerReport | None = None) -> Check:
    """`Degraded`: the job goes on but something is wrong: a container crash-loops (`crash_loop`),
    the trainer waits out an outage (`dependency_outage`) or accepts no group (`stall`). Several at
    once: the first one's reason (a crash loop's is the pod's own, the most specific), and every
    message."""
    found = [c for c in (crash_loop(containers), dependency_outage(report), stall(report)) if c is not None]
    if not found:
        return NOT_DEGRADED
    return Check("True", found[0].reason, "; ".join(c.message for c in found))


def _readiness(spec: AsyncRLJobSpec | None, obs: Observed) -> Readiness:
    rollout_desired, trainer_desired = _desired(spec)
    managed_redis = spec is not None and spec.redis.mode == "managed"
    return Readiness(
        rollout=_ready(obs.rollout_ready, rollout_desired),
        trainer=_ready(obs.trainer_ready, trainer_desired),
        # Without a valid spec nothing was created: there is no Redis of ours to wait for either.
        stream=_ready(obs.redis_ready, 1) if managed_redis else EXTERNAL_REDIS,
        weights=_weights(obs.report, obs.report_error, obs.outcome_error),
        degraded=degraded(obs.containers, obs.report),
        outage=dependency_outage(obs.report) or stall(obs.report),
    )


# ----------------------------------------------------------------------------------- phase


class Verdict(NamedTuple):
    """Where the job is in its lifecycle, and why."""

    phase: JobPhase
    reason: str
    message: str


def outcome_verdict(outcome: TrainerOutcome) -> Verdict:
    """The job's phase from the trainer's recorded outcome (its reason, e.g. MaxStepsReached)."""
    if outcome.phase == "Succeeded":
        return Verdict("Succeeded", outcome.reason or "TrainingComplete",
                       outcome.message or f"trained {outcome.step} steps (policy version {outcome.policy_version})")
    return Verdict("Failed", outcome.reason or "TrainerFailed",
                   outcome.message or f"the trainer recorded a failure at step {outcome.step}")


def _settled(spec: AsyncRLJobSpec | None, before: AsyncRLJobStatus, obs: Observed,
             invalid: str | None) -> Verdict | None:
    """The phase when no child can change it: a terminal phase (sticky), an invalid spec, the
    trainer's own outcome (the durable record, then /status), suspension. None: the trainer's
    containers, the deadlines and the children decide."""
    report = obs.report
    if before.phase in TERMINAL_PHASES:
        return Verdict(before.phase, before.reason, before.message)
    if spec is None or invalid is not None:
        return Verdict("Failed", "InvalidSpec", invalid or "invalid spec")
    if obs.outcome is not None:
        return outcome_verdict(obs.outcome)
    if report is not None and report.phase == "Succeeded":
        return Verdict("Succeeded", report.reason or "TrainingComplete",
                       report.message or f"trained {report.step} steps (policy version {report.policy_version})")
    if report is not None and report.phase == "Failed":
        return Verdict("Failed", report.reason or "TrainerFailed", report.message or "the trainer reported a failure")
    if spec.suspend:
        return Verdict("Suspended", "Suspended", "rollout and trainer scaled to zero; Redis and volumes kept")
    return None


def trainer_failure(spec: AsyncRLJobSpec, containers: list[ContainerRun]) -> Verdict | None:
    """Failed by the trainer's containers: a configuration error (exit code 78, or its termination
    message under torchrun, which exits 1 for any failed worker) at once, or more
    restarts of one container than `spec.trainer.backoffLimit`. None: keep going."""
    trainer = [c for c in containers if c.component == "trainer"]
    for c in trainer:
        if is_config_error(c.exit_code, c.exit_message):
            return Verdict("Failed", "ConfigurationError", c.exit_message.strip() or
                           f"trainer pod {c.pod} container {c.container} exited with code {EXIT_CONFIG_ERROR} "
                           "(a configuration error: restarting cannot fix it)")
    limit = spec.trainer.backoff_limit
    over = [c for c in trainer if c.restarts > limit]
    if over:
        c = max(over, key=lambda c: c.restarts)
        last = c.last_exit() or "no termination recorded"
        return Verdict("Failed", "BackoffLimitExceeded",
                       f"trainer pod {c.pod} container {c.container} restarted {c.restarts} times "
                       f"(backoffLimit {limit}); {last}")
    return None


def deadline_exceeded(spec: AsyncRLJobSpec, start: datetime, now: datetime) -> Verdict | None:
    """Failed when the job has not finished `spec.activeDeadlineSeconds` after it started (or resumed)."""
    deadline = spec.active_deadline_seconds
    if deadline is None or now - start < timedelta(seconds=deadline):
        return None
    return Verdict("Failed", "DeadlineExceeded",
                   f"not finished {deadline}s after it started at {fmt_time(start)} (activeDeadlineSeconds)")


def _progressing(spec: AsyncRLJobSpec, prev_phase: JobPhase, obs: Observed, ready: Readiness, start: datetime,
                 now: datetime) -> Verdict:
    """Pending -> Initializing -> Running, or Failed when the startup deadline passes first."""
    if obs.conflict is not None:
        return _held_by_conflict(spec, prev_phase, obs.conflict, start, now)
    problem = obs.problems[0] if obs.problems else None
    why = problem.describe() if problem else ready.waiting()
    if queued(obs) and prev_phase != "Running":  # not started yet: no startup deadline while Kueue holds it
        # the held pod first (the reason is its), then what else keeps the job's other pods waiting
        held = sorted(obs.problems, key=lambda p: p.reason != QUEUED)
        return Verdict("Pending", QUEUED, "; ".join(p.describe() for p in held))
    if ready.all_ready:
        if ready.outage is not None:  # every pod is up, yet training waits: say on what
            return Verdict("Running", ready.outage.reason, ready.outage.message)
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


def _held_by_conflict(spec: AsyncRLJobSpec, prev_phase: JobPhase, conflict: str, start: datetime,
                      now: datetime) -> Verdict:
    """A child's name is another object's: the job does not start (or, running, says so) until it is
    resolved; the startup deadline still ends a job that never could start."""
    if prev_phase == "Running":
        return Verdict("Running", CHILD_CONFLICT, conflict)
    deadline = spec.startup_deadline_seconds
    if now - start > timedelta(seconds=deadline):
        return Verdict("Failed", "StartupDeadlineExceeded", f"not running {deadline}s after start: {conflict}")
    return Verdict("Pending", CHILD_CONFLICT, conflict)


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
        "Degraded": ready.degraded,
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
             spec: AsyncRLJobSpec | None, outcome: TrainerOutcome | None = None) -> None:
    """trainer, staleness, progress, rollout.minWeightVersion, evaluation and recovery: from this
    pass's report, else the last ones written; the outcome record has the final step. trainer and progress
    stay absent until the trainer has reported, evaluation until its first held-out evaluation."""
    kept = before.model_fields_set
    if "trainer" in kept:
        status.trainer = before.trainer
    if before.evaluation is not None:
        status.evaluation = before.evaluation
    if "staleness" in kept:
        status.staleness = before.staleness
    if "progress" in kept:
        status.progress = before.progress
    if before.rollout.min_weight_version is not None:
        status.rollout.min_weight_version = before.rollout.min_weight_version
    if before.recovery is not None:  # (a finished job's pods are gone: its totals stay)
        status.recovery = before.recovery
    if report is not None and spec is not None:
        mirror_report(status, report, spec)
    if outcome is not None and spec is not None:
        mirror_outcome(status, outcome, spec)
    if "staleness" not in status.model_fields_set:
        bound = spec.staleness.as_policy().version_bound if spec is not None else 0
        status.staleness = StalenessStatus(mean=0.0, max=0, limit=bound, dropped=0)


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

    # Phase: settled by the past, the spec or the trainer; then by the trainer's containers and
    # the deadlines; otherwise by how far the children are.
    start = parse_time(before.start_time) or now
    verdict = _settled(spec, before, obs, invalid)
    if verdict is None:
        assert spec is not None  # _settled decides every job without a valid spec
        if before.phase == "Suspended" or (queued(obs) and before.phase != "Running"):
            start = now  # resumed, or still queued: both deadlines count from here
        verdict = (trainer_failure(spec, obs.containers) or deadline_exceeded(spec, start, now)
                   or _progressing(spec, before.phase, obs, ready, start, now))
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
    _figures(status, before, obs.report, spec, obs.outcome)
    return wire(status)


def ttl_expired(status: Mapping[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    """Whether a finished job has outlived ttlSecondsAfterFinished."""
    if ttl_seconds is None or status.get("phase") not in TERMINAL_PHASES:
        return False
    done = parse_time(status.get("completionTime"))
    return done is not None and now - done >= timedelta(seconds=ttl_seconds)
