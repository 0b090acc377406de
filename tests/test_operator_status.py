"""Pure status computation: phases, reasons from pod status, deadlines, stickiness, conditions."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from asyncrl.operator import status as S
from asyncrl.operator.status import JobRef, Observed, pod_problem, ttl_expired
from asyncrl.spec import AsyncRLJobSpec
from asyncrl.status_report import TrainerReport

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
REF = JobRef(name="j", namespace="ns", generation=1)


def view(**spec) -> AsyncRLJobSpec:
    """A valid spec: 2 rollout replicas, 1 trainer, 10 steps, eta 4, a 600 s startup deadline."""
    base = {"model": {"path": "m"}, "rollout": {"replicas": 2}, "trainer": {"replicas": 1, "maxSteps": 10},
            "staleness": {"maxHeadOffpolicyness": 4}, "startupDeadlineSeconds": 600}
    return AsyncRLJobSpec.model_validate({**base, **spec})


def compute_status(spec, prev, obs, now, **kw) -> dict:
    return S.compute_status(REF, spec, prev, obs, now, **kw)


EXTERNAL_REDIS = {"mode": "external", "external": {"urlSecret": {"name": "redis"}}}


def pod(**status) -> dict:
    return {"metadata": {"name": "p"}, "status": status}


def ready(n_rollout=2) -> Observed:
    return Observed(rollout_ready=n_rollout, trainer_ready=1, redis_ready=1)


def test_pod_reasons_are_recognised():
    waiting = lambda r: pod(containerStatuses=[{"name": "c", "state": {"waiting": {"reason": r}}}])  # noqa: E731
    assert pod_problem(waiting("ImagePullBackOff")).reason == "ImagePullBackOff"
    assert pod_problem(waiting("CrashLoopBackOff")).reason == "CrashLoopBackOff"
    assert pod_problem(waiting("ContainerCreating")) is None
    oom = pod(containerStatuses=[{"name": "c", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                  "lastState": {"terminated": {"reason": "OOMKilled"}}}])
    assert pod_problem(oom).reason == "OOMKilled"
    unsched = pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/3 nodes: 3 Insufficient nvidia.com/gpu"}])
    p = pod_problem(unsched)
    assert p.reason == "Unschedulable" and "nvidia.com/gpu" in p.describe()


def test_lifecycle_phases():
    s = compute_status(view(), {}, Observed(), T0)
    assert (s["phase"], s["reason"]) == ("Pending", "Creating")
    s = compute_status(view(), s, Observed(rollout_ready=0, trainer_ready=0, redis_ready=0), T0)
    assert s["phase"] == "Initializing"
    s2 = compute_status(view(), s, ready(), T0 + timedelta(seconds=5))
    assert s2["phase"] == "Running"
    conds = {c["type"]: c for c in s2["conditions"]}
    assert conds["RolloutReady"]["lastTransitionTime"] == "2026-01-01T00:00:05Z"
    s3 = compute_status(view(), s2, ready(), T0 + timedelta(seconds=50))
    assert {c["type"]: c for c in s3["conditions"]}["RolloutReady"]["lastTransitionTime"] == "2026-01-01T00:00:05Z"
    # Losing a pod after Running does not go back to Initializing, but the reason says why.
    s4 = compute_status(view(), s3, Observed(rollout_ready=1, trainer_ready=1, redis_ready=1,
                                             problems=[pod_problem({"metadata": {"name": "r1"}, "status": {
                                                 "containerStatuses": [{"name": "engine", "lastState": {
                                                     "terminated": {"reason": "OOMKilled"}}}]}})]),
                        T0 + timedelta(seconds=60))
    assert (s4["phase"], s4["reason"]) == ("Running", "OOMKilled")


def test_startup_deadline_and_stickiness():
    obs = Observed(rollout_ready=0, trainer_ready=0, redis_ready=1, problems=[
        pod_problem(pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]))])
    s = compute_status(view(startupDeadlineSeconds=60), {}, obs, T0)
    assert s["phase"] == "Initializing" and s["reason"] == "Unschedulable"
    s = compute_status(view(startupDeadlineSeconds=60), s, obs, T0 + timedelta(seconds=61))
    assert (s["phase"], s["reason"]) == ("Failed", "StartupDeadlineExceeded")
    assert "Unschedulable" in s["message"] and s["completionTime"] == "2026-01-01T00:01:01Z"
    later = compute_status(view(), s, ready(), T0 + timedelta(hours=1))
    assert later["phase"] == "Failed" and later["completionTime"] == s["completionTime"]
    assert not ttl_expired(later, None, T0 + timedelta(days=9))
    assert ttl_expired(later, 60, T0 + timedelta(seconds=121))
    assert not ttl_expired(later, 600, T0 + timedelta(seconds=121))


def test_suspend_resume_restarts_the_deadline():
    s = compute_status(view(suspend=True), {}, Observed(rollout_ready=0, trainer_ready=0, redis_ready=1), T0)
    assert s["phase"] == "Suspended" and s["rollout"]["desired"] == 0
    later = T0 + timedelta(hours=5)
    s = compute_status(view(startupDeadlineSeconds=60), s, Observed(rollout_ready=0, trainer_ready=0, redis_ready=1),
                       later)
    assert s["phase"] == "Initializing" and s["startTime"] == "2026-01-01T05:00:00Z"


def test_invalid_and_trainer_outcomes():
    s = compute_status(None, {}, Observed(), T0, invalid="invalid spec: x")
    assert (s["phase"], s["reason"], s["message"]) == ("Failed", "InvalidSpec", "invalid spec: x")
    done = compute_status(view(), {}, Observed(rollout_ready=2, trainer_ready=1, redis_ready=1,
                                               report=TrainerReport(phase="Succeeded", step=10, policy_version=10)), T0)
    assert done["phase"] == "Succeeded" and done["progress"]["percent"] == 100.0
    assert {c["type"]: c["status"] for c in done["conditions"]}["Complete"] == "True"
    failed = compute_status(view(), {}, Observed(report=TrainerReport(phase="Failed", message="NaN loss")), T0)
    assert (failed["phase"], failed["message"]) == ("Failed", "NaN loss")


def test_external_redis_stream_ready():
    s = compute_status(view(redis=EXTERNAL_REDIS), {}, Observed(rollout_ready=2, trainer_ready=1), T0)
    assert s["phase"] == "Running"
    assert {c["type"]: c["reason"] for c in s["conditions"]}["StreamReady"] == "External"
