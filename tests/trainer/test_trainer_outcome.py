"""The trainer's end of life: the outcome is recorded (Redis, then outcome.json), the trainer stays
up serving it until SIGTERM, a restarted trainer serves it without loading the model or touching
anything, a re-created job (new uid) does not see it, and a misconfigured job exits 78."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from asyncrl.api.outcome import EXIT_CONFIG_ERROR, new_outcome, read_outcome_file, read_outcome_redis
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.net import free_port
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import (
    ASYNCRL,
    make_groups,
    publish,
    read_jsonl,
    redis_query,
    stop_trainer,
    trainer_env,
    wait_for_outcome,
)

JOB = "t-outcome"
UID = "1b7e0c2a-0000-4000-8000-000000000001"
OTHER_UID = "1b7e0c2a-0000-4000-8000-000000000002"
SERVED_FROM_RECORD = "serving it without loading the model"


def _start(tmp: Path, job_file: Path, redis_url: str, port: int | None, log: str, *extra: str,
           uid: str = UID) -> subprocess.Popen:
    cmd = ASYNCRL + ["trainer", "--config", str(job_file), "--threads", "1", *extra]
    cmd += ["--status-port", str(port), "--status-host", "127.0.0.1"] if port else ["--no-status"]
    with open(tmp / log, "ab") as out:
        return subprocess.Popen(cmd, env=trainer_env(tmp, redis_url, uid=uid), cwd=tmp, stdout=out,
                                stderr=subprocess.STDOUT)


def _status(port: int, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> dict[str, Any]:
    """The first /status document whose phase is final (Succeeded or Failed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            doc = httpx.get(f"http://127.0.0.1:{port}/status", timeout=2).json()
            if doc["phase"] in ("Succeeded", "Failed"):
                return doc
        except (httpx.HTTPError, ValueError):
            pass
        assert proc.poll() is None, f"trainer exited ({proc.returncode})\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def _still_running(proc: subprocess.Popen, seconds: float = 3.0) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def _snapshot(tmp: Path, redis_url: str, names: StreamNames) -> dict[str, Any]:
    """Everything a trainer could touch: weight and checkpoint files (with mtimes), metrics.jsonl,
    and every Redis key of the job as DUMP bytes (streams with their groups, pending entries and
    consumers, acks, admission, versions, engines, the outcome record)."""
    def files(root: Path) -> dict[str, float]:
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}

    async def dumps(r: Any) -> dict[str, Any]:
        return {key: await r.dump(key) for key in names.all_keys()}

    return {"weights": files(tmp / "weights"), "checkpoints": files(tmp / "checkpoints"),
            "metrics": (tmp / "metrics.jsonl").read_text(), "redis": redis_query(redis_url, dumps)}


@pytest.mark.slow
def test_max_steps_records_succeeded_and_a_restart_serves_it_without_training(tmp_path: Path, redis_url: str):
    job_file = JobBuilder.small(name=JOB, batch_size=2, group_size=2, max_steps=1,
                                checkpoint_interval=1).write(tmp_path / "job.yaml")
    publish(redis_url, JOB, make_groups(JOB, 2, group_size=2), uid=UID)
    names = StreamNames.for_job(JOB, UID)

    # 1. Train to max steps: the outcome is recorded, in Redis and in the file ...
    port = free_port()
    proc = _start(tmp_path, job_file, redis_url, port, "trainer-1.log")
    try:
        outcome = wait_for_outcome(redis_url, JOB, proc, uid=UID, log=tmp_path / "trainer-1.log")
        assert (outcome.phase, outcome.reason, outcome.step, outcome.policy_version) == \
            ("Succeeded", "MaxStepsReached", 1, 1)
        assert outcome.job == JOB and outcome.job_uid == UID
        assert outcome.weights_path == str((tmp_path / "weights" / "v1").resolve())
        assert outcome.report is not None and outcome.report["groups_trained"] == 2
        # The file is written right after the Redis record: wait for it, then it is the same outcome.
        deadline = time.monotonic() + 30
        while read_outcome_file(tmp_path / "weights", UID) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_outcome_file(tmp_path / "weights", UID) == outcome
        # ... and the trainer stays up, serving it, until SIGTERM.
        status = _status(port, proc, tmp_path / "trainer-1.log")
        assert (status["phase"], status["reason"], status["step"], status["policy_version"]) == \
            ("Succeeded", "MaxStepsReached", 1, 1)
        assert status["final_weights"] == outcome.weights_path and status["outcome_restored"] is False
        assert _still_running(proc)
    finally:
        code = stop_trainer(proc)
    assert code == 0
    assert not (tmp_path / "termination-log").exists()  # (written on failures only)
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    before = _snapshot(tmp_path, redis_url, names)
    assert before["redis"][names.trajectories] is not None and before["redis"][names.trained] is not None

    # 2. The pod restarts (StatefulSet): the outcome is served at once, nothing is loaded or touched.
    port = free_port()
    proc = _start(tmp_path, job_file, redis_url, port, "trainer-2.log")
    try:
        status = _status(port, proc, tmp_path / "trainer-2.log")
        assert status["outcome_restored"] is True
        assert (status["phase"], status["reason"], status["step"], status["policy_version"]) == \
            ("Succeeded", "MaxStepsReached", 1, 1)
        assert status["groups_trained"] == 2  # the last report, from the record
        assert _still_running(proc, 1.0)
    finally:
        code = stop_trainer(proc)
    assert code == 0
    log = (tmp_path / "trainer-2.log").read_text()
    assert SERVED_FROM_RECORD in log and "resumed from" not in log
    assert _snapshot(tmp_path, redis_url, names) == before

    # 3. Redis lost its data: the file is the fallback, and the record goes back into Redis.
    redis_query(redis_url, lambda r: r.delete(names.outcome))
    proc = _start(tmp_path, job_file, redis_url, None, "trainer-3.log")
    try:
        assert wait_for_outcome(redis_url, JOB, proc, uid=UID, timeout=120) == outcome
        assert _still_running(proc, 1.0)
    finally:
        code = stop_trainer(proc)
    assert code == 0 and SERVED_FROM_RECORD in (tmp_path / "trainer-3.log").read_text()
    assert _snapshot(tmp_path, redis_url, names) == before


def test_a_new_job_uid_does_not_see_the_old_outcome(tmp_path: Path, redis_url: str):
    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.main import OutcomeRecord
    from asyncrl.transport.connection import RedisUnavailableError

    job = JobBuilder.small(name=JOB).job()

    def record(uid: str, url: str = redis_url) -> OutcomeRecord:
        rt = Runtime(redis_url=url, weights_dir=tmp_path / "weights", job_uid=uid)
        return OutcomeRecord(job, rt, rt.stream_names(JOB), connect_timeout=0.5)

    async def go(rec: OutcomeRecord, what: str, *args: Any) -> Any:
        try:
            return await getattr(rec, what)(*args)
        finally:
            await rec.close()

    done = new_outcome(JOB, UID, "Succeeded", "MaxStepsReached", step=2, policy_version=2)
    assert asyncio.run(go(record(UID), "record", done)) == done
    # The first outcome wins: a later one is not recorded, the earlier one is returned.
    late = new_outcome(JOB, UID, "Failed", "WeightSyncFailed")
    assert asyncio.run(go(record(UID), "record", late)) == done
    assert read_outcome_file(tmp_path / "weights", UID) == done
    assert asyncio.run(go(record(UID), "find")) == done

    # The job deleted and re-created under the same name: other keys, and the file is not its own.
    assert not set(StreamNames.for_job(JOB, UID).all_keys()) & set(StreamNames.for_job(JOB, OTHER_UID).all_keys())
    assert asyncio.run(go(record(OTHER_UID), "find")) is None
    assert asyncio.run(go(record(""), "find")) is None

    # Redis unreachable: the file still answers for its uid; without a record the error is raised.
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert asyncio.run(go(record(UID, dead), "find")) == done
    with pytest.raises(RedisUnavailableError):
        asyncio.run(go(record(OTHER_UID, dead), "find"))
    # An unreadable file is no outcome.
    (tmp_path / "weights" / "outcome.json").write_text("{half a rec")
    redis_query(redis_url, lambda r: r.delete(StreamNames.for_job(JOB, UID).outcome))
    assert asyncio.run(go(record(UID), "find")) is None


def test_an_invalid_job_file_exits_78_with_a_termination_message(tmp_path: Path, redis_url: str):
    bad = tmp_path / "job.yaml"
    doc = yaml.safe_load(JobBuilder.small(name=JOB).write(bad).read_text())
    doc["spec"]["algorithm"]["groupSize"] = "many"
    bad.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(ASYNCRL + ["trainer", "--config", str(bad), "--no-status"], cwd=tmp_path,
                          env=trainer_env(tmp_path, redis_url, uid=UID), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("InvalidJobFile: ") and "groupSize" in message
    assert "groupSize" in proc.stderr  # the located errors, as `asyncrl validate` prints them


@pytest.mark.slow
def test_a_model_that_cannot_be_found_exits_78_and_records_failed(tmp_path: Path, redis_url: str):
    doc = yaml.safe_load(JobBuilder.small(name=JOB).write(tmp_path / "job.yaml").read_text())
    doc["spec"]["model"]["path"] = str(tmp_path / "no-such-model")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(ASYNCRL + ["trainer", "--config", str(tmp_path / "job.yaml"), "--no-status"],
                          cwd=tmp_path, env=trainer_env(tmp_path, redis_url, uid=UID), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "termination-log").read_text().startswith("ModelNotFound: ")
    # The job is known by then: the Failed outcome is recorded too (the operator also reads that;
    # under torchrun the container's exit code is torchrun's, not 78).
    names = StreamNames.for_job(JOB, UID)
    outcome = redis_query(redis_url, lambda r: read_outcome_redis(r, names))
    assert outcome is not None and (outcome.phase, outcome.reason) == ("Failed", "ModelNotFound")


@pytest.mark.slow
def test_non_finite_weights_record_failed_and_are_never_published(tmp_path: Path, redis_url: str):
    # AdamW's decoupled weight decay multiplies every weight by (1 - lr * wd) = -1e295: Inf in float32.
    decaying = {"optimizer": {"lr": 1e-5, "weightDecay": 1e300}}
    job_file = JobBuilder.small(name=JOB, batch_size=2, group_size=2, max_steps=2,
                                algorithm=decaying).write(tmp_path / "job.yaml")
    publish(redis_url, JOB, make_groups(JOB, 2, group_size=2), uid=UID)
    port = free_port()
    proc = _start(tmp_path, job_file, redis_url, port, "trainer.log")
    try:
        outcome = wait_for_outcome(redis_url, JOB, proc, uid=UID, log=tmp_path / "trainer.log")
        assert (outcome.phase, outcome.reason, outcome.step, outcome.policy_version) == \
            ("Failed", "NonFiniteWeights", 0, 0)
        assert "non-finite" in outcome.message and outcome.weights_path is None
        status = _status(port, proc, tmp_path / "trainer.log")
        assert (status["phase"], status["reason"]) == ("Failed", "NonFiniteWeights")
        assert (tmp_path / "termination-log").read_text().startswith("NonFiniteWeights: ")
        assert _still_running(proc)
    finally:
        code = stop_trainer(proc)
    assert code == 0
    assert not (tmp_path / "weights" / "v1").exists()
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
