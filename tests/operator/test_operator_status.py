"""Pure status computation: phases, reasons from pod status, deadlines, stickiness, conditions."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from asyncrl.api.outcome import TrainerOutcome, new_outcome
from asyncrl.api.spec import AsyncRLJobSpec, RecoveryStatus
from asyncrl.api.status_report import RecoveryReport, TrainerReport
from asyncrl.operator import status as S
from asyncrl.operator.mirror import QUIET_RECOVERY, RECOVERY_EVENTS, recovery_events
from asyncrl.operator.status import JobRef, Observed, pod_problem, ttl_expired

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


# ----------------------------------------------------------------------------------- outcome, failures


def trainer_pod(name="j-trainer-0", component="trainer", **cs) -> dict:
    """A pod of the job with one container status (`cs`: restartCount, state, lastState, ready)."""
    status = {"name": "trainer" if component == "trainer" else "worker", "ready": False, "restartCount": 0, **cs}
    return {"metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
            "status": {"containerStatuses": [status]}}


def runs(*pods) -> list[S.ContainerRun]:
    return S.container_runs(list(pods))


def crashed(code=1, reason="Error", message="Traceback: boom") -> dict:
    return {"terminated": {"exitCode": code, "reason": reason, "message": message}}


def outcome(phase="Succeeded", reason="MaxStepsReached", **kw) -> TrainerOutcome:
    return new_outcome("j", "uid-1", phase, reason, **{"step": 10, "policy_version": 10, **kw})


def conds(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_container_runs_read_restarts_and_the_last_termination():
    [c] = runs(trainer_pod(restartCount=2, lastState=crashed(137, "OOMKilled", ""),
                           state={"waiting": {"reason": "CrashLoopBackOff"}}))
    assert (c.pod, c.component, c.container, c.restarts) == ("j-trainer-0", "trainer", "trainer", 2)
    assert (c.exit_code, c.exit_reason, c.waiting_reason) == (137, "OOMKilled", "CrashLoopBackOff")
    assert c.crash_looping and c.last_exit() == "last exit code 137 (OOMKilled)"
    # A container that is terminated right now: its current state is the last termination.
    [c] = runs(trainer_pod(state=crashed(78, "Error", "bad spec"), lastState=crashed(1)))
    assert (c.exit_code, c.exit_message) == (78, "bad spec")
    [c] = runs(trainer_pod(ready=True, restartCount=1, lastState=crashed()))
    assert not c.crash_looping, "restarted once and ready again is not a crash loop"
    assert runs({"metadata": {"name": "p"}, "status": {}}) == []


def test_backoff_limit_counts_restarts_of_a_trainer_container():
    spec = view(trainer={"replicas": 1, "maxSteps": 10, "backoffLimit": 2})
    assert S.trainer_failure(spec, runs(trainer_pod(restartCount=2, lastState=crashed()))) is None
    v = S.trainer_failure(spec, runs(trainer_pod(restartCount=3, lastState=crashed(1, "Error", "RuntimeError: x"))))
    assert (v.phase, v.reason) == ("Failed", "BackoffLimitExceeded")
    assert "restarted 3 times (backoffLimit 2)" in v.message
    assert "last exit code 1 (Error): RuntimeError: x" in v.message and "j-trainer-0" in v.message
    # Rollout restarts never fail the job; the default limit is 3.
    assert S.trainer_failure(view(), runs(trainer_pod("r", "rollout", restartCount=50))) is None
    assert view().trainer.backoff_limit == 3
    assert S.trainer_failure(view(), runs(trainer_pod(restartCount=4))).reason == "BackoffLimitExceeded"


def test_exit_code_78_is_a_configuration_error_at_once():
    config_error = crashed(78, "Error", "dataset: no such file\n")
    v = S.trainer_failure(view(), runs(trainer_pod(restartCount=1, lastState=config_error,
                                                   state={"waiting": {"reason": "CrashLoopBackOff"}})))
    assert (v.phase, v.reason, v.message) == ("Failed", "ConfigurationError", "dataset: no such file")
    v = S.trainer_failure(view(), runs(trainer_pod(state=crashed(78, "Error", ""))))
    assert v.reason == "ConfigurationError" and "exited with code 78" in v.message
    # Under torchrun a worker's exit code 78 becomes 1: the termination message still says why.
    v = S.trainer_failure(view(), runs(trainer_pod(state=crashed(1, "Error", "ModelNotFound: no model at /m\n"))))
    assert (v.reason, v.message) == ("ConfigurationError", "ModelNotFound: no model at /m")
    assert S.trainer_failure(view(), runs(trainer_pod(state=crashed(1, "Error", "Crashed: RuntimeError: x")))) is None
    obs = Observed(rollout_ready=2, trainer_ready=0, redis_ready=1, containers=runs(trainer_pod(state=crashed(78))))
    s = compute_status(view(), {}, obs, T0)
    assert (s["phase"], s["reason"]) == ("Failed", "ConfigurationError") and s["completionTime"]
    assert conds(s)["Failed"]["status"] == "True"
    # A suspended job has no pods of its own: a lingering terminated container does not fail it.
    assert compute_status(view(suspend=True), {}, obs, T0)["phase"] == "Suspended"


def test_active_deadline_counts_from_start_and_restarts_on_resume():
    spec = view(activeDeadlineSeconds=60)
    s = compute_status(spec, {}, ready(), T0)
    assert s["phase"] == "Running"
    assert compute_status(spec, s, ready(), T0 + timedelta(seconds=59))["phase"] == "Running"
    failed = compute_status(spec, s, ready(), T0 + timedelta(seconds=60))
    assert (failed["phase"], failed["reason"]) == ("Failed", "DeadlineExceeded")
    assert "60s" in failed["message"] and failed["completionTime"] == "2026-01-01T00:01:00Z"
    assert compute_status(view(), s, ready(), T0 + timedelta(days=3))["phase"] == "Running", "unset: no limit"
    suspended = compute_status(view(activeDeadlineSeconds=60, suspend=True), s, Observed(), T0 + timedelta(hours=1))
    assert suspended["phase"] == "Suspended"
    resumed = compute_status(spec, suspended, ready(), T0 + timedelta(hours=2))
    assert resumed["phase"] == "Running" and resumed["startTime"] == "2026-01-01T02:00:00Z"


def test_outcome_record_ends_the_job_and_carries_the_final_step():
    s = compute_status(view(), {}, ready(), T0)
    done = compute_status(view(), s, Observed(rollout_ready=2, trainer_ready=1, redis_ready=1,
                                              outcome=outcome(step=10, policy_version=10, message="")),
                          T0 + timedelta(seconds=5))
    assert (done["phase"], done["reason"]) == ("Succeeded", "MaxStepsReached")
    assert done["message"] == "trained 10 steps (policy version 10)"
    assert done["completionTime"] == "2026-01-01T00:00:05Z"
    assert done["trainer"] == {"step": 10, "policyVersion": 10} and done["progress"]["percent"] == 100.0
    assert conds(done)["Complete"]["status"] == "True" and conds(done)["Complete"]["reason"] == "MaxStepsReached"
    # The durable record wins over a live report that says something else.
    racing = Observed(report=TrainerReport(phase="Training", step=9), outcome=outcome("Failed", "TooManyBadSteps",
                                                                                      message="NaN loss 5 times"))
    failed = compute_status(view(), s, racing, T0)
    assert (failed["phase"], failed["reason"], failed["message"]) == ("Failed", "TooManyBadSteps", "NaN loss 5 times")
    # Terminal is sticky: a later outcome, report or pod state changes nothing.
    later = compute_status(view(), done, Observed(outcome=outcome("Failed", "X"),
                                                  containers=runs(trainer_pod(state=crashed(78)))),
                           T0 + timedelta(hours=1))
    assert (later["phase"], later["reason"], later["completionTime"]) == ("Succeeded", "MaxStepsReached",
                                                                         done["completionTime"])


def test_crash_looping_rollout_pod_is_degraded_not_failed():
    s = compute_status(view(), {}, ready(), T0)
    assert conds(s)["Degraded"]["status"] == "False"
    looping = trainer_pod("j-rollout-x", "rollout", restartCount=4, state={"waiting": {"reason": "CrashLoopBackOff"}},
                          lastState=crashed(1, "Error", "redis: connection refused"))
    obs = Observed(rollout_ready=2, trainer_ready=1, redis_ready=1, containers=runs(looping))
    s = compute_status(view(), s, obs, T0 + timedelta(seconds=10))
    assert s["phase"] == "Running"
    d = conds(s)["Degraded"]
    assert (d["status"], d["reason"]) == ("True", "CrashLoopBackOff")
    assert "j-rollout-x" in d["message"] and "4 restarts" in d["message"] and "connection refused" in d["message"]
    assert d["lastTransitionTime"] == "2026-01-01T00:00:10Z"
    oom = trainer_pod("j-rollout-y", "rollout", restartCount=1, lastState=crashed(137, "OOMKilled", ""))
    assert S.degraded(runs(oom)).reason == "OOMKilled"
    # The trainer below its backoff limit is degraded too; the job fails only past the limit.
    s = compute_status(view(), s, Observed(rollout_ready=2, trainer_ready=0, redis_ready=1,
                                           containers=runs(trainer_pod(restartCount=1, lastState=crashed()))),
                       T0 + timedelta(seconds=20))
    assert s["phase"] == "Running" and conds(s)["Degraded"]["status"] == "True"
    assert [c["type"] for c in s["conditions"]] == ["RolloutReady", "TrainerReady", "StreamReady", "WeightsSynced",
                                                    "Degraded", "Complete", "Failed"]


def test_status_write_is_an_exact_merge_patch():
    from asyncrl.operator.handlers import merge_patch

    old = {"phase": "Running", "progress": {"percent": 5.0, "rewardMean": 0.5}, "conditions": [1, 2], "x": 1}
    new = {"phase": "Running", "progress": {"percent": 6.0}, "conditions": [1, 2, 3]}
    patch = merge_patch(old, new)
    assert patch == {"x": None, "progress": {"percent": 6.0, "rewardMean": None}, "conditions": [1, 2, 3]}
    assert merge_patch(new, new) == {}


def test_redis_url_and_secret_values():
    import base64

    from asyncrl.operator.mirror import DEFAULT_REDIS_URL_TEMPLATE, managed_redis_url, secret_value

    assert managed_redis_url(DEFAULT_REDIS_URL_TEMPLATE, name="j", namespace="ns", service="j-redis", port=6379,
                             password="p/w") == "redis://:p%2Fw@j-redis.ns.svc:6379/0"
    api = {"data": {"password": base64.b64encode(b"s3cret").decode()}}
    assert secret_value(api, "password") == "s3cret"
    assert secret_value({"stringData": {"url": "redis://x"}}, "url") == "redis://x"
    assert secret_value(None, "url") is None and secret_value({"data": {"url": "%%%"}}, "url") is None


async def test_outcome_reader_reads_the_record_and_tolerates_an_unreachable_redis(redis_server):
    import pytest

    from asyncrl.api.outcome import write_outcome_redis
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.operator.mirror import MirrorError, OutcomeReader, RedisSettings
    from asyncrl.transport.connection import connect

    reader = OutcomeReader(RedisSettings(timeout=1.0))
    names = StreamNames.for_job("j", "uid-1")
    try:
        assert await reader.read("k", redis_server.url, names, "uid-1") is None
        assert reader.url("k") == redis_server.url, "the client is kept for the next pass"
        client = await connect(redis_server.url)
        assert await write_outcome_redis(client, names, outcome())
        await client.aclose()
        got = await reader.read("k", redis_server.url, names, "uid-1")
        assert got is not None and (got.phase, got.reason, got.step) == ("Succeeded", "MaxStepsReached", 10)
        other = StreamNames.for_job("j", "uid-2")
        assert await reader.read("k", redis_server.url, other, "uid-2") is None, "another run's keys"
        redis_server.stop()
        with pytest.raises(MirrorError, match="outcome record"):
            await reader.read("k", redis_server.url, names, "uid-1")
        assert reader.url("k") is None, "a failed client is dropped"
    finally:
        await reader.close()


def test_live_report_reason_ends_the_job_when_no_record_was_read():
    report = TrainerReport(phase="Failed", reason="WeightSyncFailed", message="engine 2 rejected the weights")
    s = compute_status(view(), {}, Observed(report=report), T0)
    assert (s["phase"], s["reason"], s["message"]) == ("Failed", "WeightSyncFailed", "engine 2 rejected the weights")
    s = compute_status(view(), {}, Observed(report=TrainerReport(phase="Succeeded", step=10, policy_version=10)), T0)
    assert (s["reason"], s["message"]) == ("TrainingComplete", "trained 10 steps (policy version 10)")


def outage_report(*outages: tuple[str, str, float], reason: str = "RedisUnavailable") -> TrainerReport:
    """The trainer's /status document while it waits out outages, parsed as the operator's mirror
    parses it (TrainerReport.model_validate of the JSON): (dependency, target, since) each."""
    since = min(o[2] for o in outages)
    return TrainerReport.model_validate({
        "job": "j", "phase": "Waiting", "step": 3,
        "degraded": {"status": True, "reason": reason, "message": "Redis ... unreachable for 12s", "since": since,
                     "outages": [{"dependency": dep, "target": target, "since": at, "seconds": 12.0,
                                  "last_error": "ConnectionError: Connection refused", "failures": 7,
                                  "window_s": 180.0} for dep, target, at in outages]}})


def test_an_outage_the_trainer_waits_out_is_the_degraded_condition():
    """The trainer's /status `degraded` becomes Degraded=True with its reason and a message naming
    what is unreachable and since when; the job stays Running (its reason says why it waits) and the
    condition and message do not change from pass to pass while the outage lasts; recovery clears it."""
    t_down = (T0 + timedelta(seconds=30)).timestamp()
    s = compute_status(view(), {}, ready(), T0)
    assert conds(s)["Degraded"]["status"] == "False" and conds(s)["Degraded"]["reason"] == "Healthy"
    down = Observed(rollout_ready=2, trainer_ready=1, redis_ready=1,
                    report=outage_report(("redis", "j-redis.ns.svc:6379/0", t_down)))
    s1 = compute_status(view(), s, down, T0 + timedelta(seconds=40))
    d = conds(s1)["Degraded"]
    assert (d["status"], d["reason"]) == ("True", "RedisUnavailable")
    assert d["message"] == ("the trainer is waiting: Redis j-redis.ns.svc:6379/0 unreachable since "
                            "2026-01-01T00:00:30Z (ConnectionError: Connection refused), retrying for up to 180s")
    assert d["lastTransitionTime"] == "2026-01-01T00:00:40Z"
    assert (s1["phase"], s1["reason"], s1["message"]) == ("Running", "RedisUnavailable", d["message"])
    assert s1["trainer"]["step"] == 3, "the rest of the report is mirrored as before"
    s2 = compute_status(view(), s1, down, T0 + timedelta(seconds=70))
    assert conds(s2)["Degraded"] == d and (s2["reason"], s2["message"]) == (s1["reason"], s1["message"])
    # Back: Degraded=False, the job's reason is Running again.
    healthy = Observed(rollout_ready=2, trainer_ready=1, redis_ready=1, report=TrainerReport(phase="Training", step=4))
    s3 = compute_status(view(), s2, healthy, T0 + timedelta(seconds=80))
    assert (conds(s3)["Degraded"]["status"], conds(s3)["Degraded"]["reason"]) == ("False", "Healthy")
    assert conds(s3)["Degraded"]["lastTransitionTime"] == "2026-01-01T00:01:20Z"
    assert (s3["phase"], s3["reason"]) == ("Running", "Running")


def test_engine_outages_and_a_crash_loop_at_once():
    t = (T0 + timedelta(seconds=5)).timestamp()
    engines = outage_report(("engine", "http://10.0.0.7:30000", t), ("engine", "http://10.0.0.8:30000", t + 1),
                            reason="EngineUnavailable")
    check = S.degraded([], engines)
    assert (check.status, check.reason) == ("True", "EngineUnavailable")
    assert "engine http://10.0.0.7:30000 unreachable since 2026-01-01T00:00:05Z" in check.message
    assert "http://10.0.0.8:30000 unreachable since 2026-01-01T00:00:06Z" in check.message
    # A report that names no reason (an older trainer): the first outage's dependency decides.
    bare = engines.model_copy(update={"degraded": engines.degraded.model_copy(update={"reason": ""})})
    assert S.degraded([], bare).reason == "EngineUnavailable"
    # A crash loop and an outage: the pod's reason (the more specific), both in the message.
    looping = runs(trainer_pod("j-rollout-x", "rollout", restartCount=4,
                               state={"waiting": {"reason": "CrashLoopBackOff"}}))
    both = S.degraded(looping, outage_report(("redis", "r:6379/0", t)))
    assert (both.status, both.reason) == ("True", "CrashLoopBackOff")
    assert "j-rollout-x" in both.message and "Redis r:6379/0 unreachable since" in both.message
    # No report (the trainer's endpoint did not answer) or a healthy one: not degraded by an outage.
    assert S.degraded([], None) == S.degraded([], TrainerReport()) == S.NOT_DEGRADED


def stalled_report(count: int, since: float) -> TrainerReport:
    """The trainer's /status while every group's reward fails, parsed as the operator's mirror parses it."""
    return TrainerReport.model_validate({
        "job": "j", "phase": "Waiting", "step": 0,
        "stalled": {"reason": "RewardFailures", "count": count, "since": since, "seconds": 75.0,
                    "last_error": "prompt p3: RuntimeError: verifier down",
                    "message": f"{count} groups dropped because their reward could not be computed (last error: "
                               "prompt p3: RuntimeError: verifier down)", "dropped": {"reward_failures": count}}})


def test_a_stall_the_trainer_reports_is_the_degraded_condition_and_the_running_jobs_reason():
    """/status `stalled` becomes Degraded=True with the cause as its reason, the job's reason while
    Running (`kubectl get -o wide` shows it), the count and the last error in the message; an outage
    the trainer waits out comes first; the first step clears it."""
    since = (T0 + timedelta(seconds=5)).timestamp()
    s1 = compute_status(view(), {}, running(stalled_report(12, since)), T0 + timedelta(seconds=80))
    d = conds(s1)["Degraded"]
    assert (d["status"], d["reason"]) == ("True", "RewardFailures")
    assert d["message"] == ("no group accepted for training since 2026-01-01T00:00:05Z: 12 groups dropped because "
                            "their reward could not be computed (last error: prompt p3: RuntimeError: verifier down)")
    assert (s1["phase"], s1["reason"], s1["message"]) == ("Running", "RewardFailures", d["message"])
    outage = outage_report(("redis", "r:6379/0", since)).degraded
    both = stalled_report(12, since).model_copy(update={"degraded": outage})
    s2 = compute_status(view(), s1, running(both), T0 + timedelta(seconds=90))
    assert (s2["reason"], conds(s2)["Degraded"]["reason"]) == ("RedisUnavailable", "RedisUnavailable")
    assert "12 groups dropped" in conds(s2)["Degraded"]["message"]
    s3 = compute_status(view(), s2, running(TrainerReport(phase="Training", step=1)), T0 + timedelta(seconds=99))
    assert (s3["reason"], conds(s3)["Degraded"]["reason"]) == ("Running", "Healthy")


def test_recovery_totals_outlive_the_trainers_report_and_each_one_that_grows_sends_an_event():
    """A finished job's pods are gone, so no report is read: status.recovery keeps the last totals.
    Every recovery figure but the quiet ones has an Event, sent when it grows."""
    s1 = compute_status(view(), {}, running(TrainerReport(phase="Waiting", recovery=RecoveryReport(
        reward_failures=7, engine_requeues=2))), T0)
    assert (s1["recovery"]["rewardFailures"], s1["recovery"]["engineRequeues"]) == (7, 2)
    s2 = compute_status(view(), s1, Observed(), T0 + timedelta(seconds=5))
    assert s2["recovery"] == s1["recovery"]
    fields = {f.serialization_alias or f.alias or name for name, f in RecoveryStatus.model_fields.items()}
    assert {key for key, *_ in RECOVERY_EVENTS} | set(QUIET_RECOVERY) == fields
    events = recovery_events({"rewardFailures": 1, "generationFailures": 0},
                             {"rewardFailures": 4, "generationFailures": 2})
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "RewardsFailed"),
                                                              ("Warning", "GenerationFailed")]
    assert events[0][2].startswith("3 more trajectory group(s) dropped") and events[0][2].endswith("(4 now)")


def eval_record(version: int, pass_at_1: float, **extra: object) -> dict[str, object]:
    """One entry of the trainer's /status `evaluations`, as JSON (what the mirror parses)."""
    return {"policy_version": version, "reward_mean": pass_at_1 + 0.01, "pass_at_1": pass_at_1, "k": 1,
            "prompts": 64, "samples": 64, **extra}


def running(report: TrainerReport) -> Observed:
    return Observed(rollout_ready=2, trainer_ready=1, redis_ready=1, report=report)


def test_the_newest_evaluation_is_mirrored_for_the_eval_column():
    """status.evaluation (what the `Eval` printer column shows) is absent until the trainer reports
    an evaluation, then holds the one of the highest policy version: summary pass@1 to 2 decimals
    @ version; pass@k only when k > 1."""
    s0 = compute_status(view(), {}, running(TrainerReport(phase="Training", step=3)), T0)
    assert "evaluation" not in s0
    report = TrainerReport.model_validate({"phase": "Training", "step": 16, "policy_version": 16, "evaluations": [
        eval_record(0, 0.05), eval_record(14, 0.4167), eval_record(7, 0.3)]})  # v14 finished before v7
    s1 = compute_status(view(), s0, running(report), T0 + timedelta(seconds=10))
    assert s1["evaluation"] == {"policyVersion": 14, "rewardMean": 0.4267, "passAt1": 0.4167, "k": 1,
                                "summary": "0.42@v14"}
    # The trainer does not answer this pass: the last evaluation written stays, as the step does.
    s2 = compute_status(view(), s1, ready(), T0 + timedelta(seconds=20))
    assert s2["evaluation"] == s1["evaluation"] and s2["trainer"]["step"] == 16
    # A restarted trainer whose report has no evaluations yet does not erase it either.
    s3 = compute_status(view(), s2, running(TrainerReport(phase="Training", step=17)),
                        T0 + timedelta(seconds=30))
    assert s3["evaluation"] == s1["evaluation"] and s3["trainer"]["step"] == 17
    # k = 4 answers per prompt: pass@k is mirrored; the same version evaluated again: the later result.
    sampled = TrainerReport.model_validate({"phase": "Training", "step": 21, "evaluations": [
        eval_record(20, 0.25, k=4, pass_at_k=0.5), eval_record(20, 0.2567, k=4, pass_at_k=0.625)]})
    s4 = compute_status(view(), s3, running(sampled), T0 + timedelta(seconds=40))
    assert s4["evaluation"] == {"policyVersion": 20, "rewardMean": 0.2667, "passAt1": 0.2567, "passAtK": 0.625,
                                "k": 4, "summary": "0.26@v20"}
    from asyncrl.api.spec import AsyncRLJobStatus

    assert AsyncRLJobStatus.model_validate(s4).evaluation.summary == "0.26@v20"  # the CRD's own model reads it


def gated(name: str) -> dict:
    """A pod Kueue holds: its admission scheduling gate, PodScheduled False/SchedulingGated."""
    return {"metadata": {"name": name}, "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                            "reason": "SchedulingGated"}]}}


def test_a_job_kueue_holds_is_queued_and_its_deadline_counts_from_admission():
    """spec.queueName: while Kueue holds the pods (for longer than the startup deadline) the job is
    Pending/Queued, not Failed; once admitted, the startup deadline counts from then."""
    spec = view(startupDeadlineSeconds=60, queueName="gpu-team")
    problems = S.pod_problems([gated("j-trainer-0"), gated("j-rollout-abc")])
    assert [p.reason for p in problems] == ["Queued", "Queued"] and "Kueue" in problems[0].describe()
    held = Observed(rollout_ready=0, trainer_ready=0, redis_ready=1, problems=problems)
    s = compute_status(spec, {}, held, T0)
    for hours in (1, 5):
        s = compute_status(spec, s, held, T0 + timedelta(hours=hours))
        assert (s["phase"], s["reason"]) == ("Pending", "Queued"), s
    assert s["startTime"] == "2026-01-01T05:00:00Z"
    admitted = T0 + timedelta(hours=5, seconds=1)
    waiting = Observed(rollout_ready=0, trainer_ready=0, redis_ready=1)
    s = compute_status(spec, s, waiting, admitted)
    assert s["phase"] == "Initializing"
    s = compute_status(spec, s, waiting, admitted + timedelta(seconds=30))
    assert s["phase"] == "Initializing", "the 60 s deadline counts from admission, not from creation"
    s = compute_status(spec, s, waiting, admitted + timedelta(seconds=61))
    assert (s["phase"], s["reason"]) == ("Failed", "StartupDeadlineExceeded")


def test_why_the_trainer_could_not_be_read_reaches_the_weights_condition():
    obs = ready()
    obs.report_error = "GET http://j-status:8000/status: connection refused"
    obs.outcome_error = "the Redis URL is not known yet (its Secret is missing or incomplete)"
    s = compute_status(view(), {}, obs, T0)
    weights = {c["type"]: c for c in s["conditions"]}["WeightsSynced"]
    assert (weights["status"], weights["reason"]) == ("Unknown", "NoReport")
    assert "connection refused" in weights["message"] and "Secret is missing" in weights["message"]
    quiet = {c["type"]: c for c in compute_status(view(), {}, ready(), T0)["conditions"]}["WeightsSynced"]
    assert quiet["message"] == "the trainer's status endpoint has not answered yet"
