"""The trainer's outcome record (asyncrl.api.outcome) and the job uid in every Redis key."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.api.outcome import (
    ENV_TERMINATION_LOG,
    OUTCOME_FILE,
    TrainerOutcome,
    new_outcome,
    read_outcome_file,
    read_outcome_redis,
    read_outcome_redis_sync,
    termination_log_path,
    write_outcome_file,
    write_outcome_redis,
    write_termination_message,
)
from asyncrl.api.runtime import Runtime
from asyncrl.api.stream_names import StreamNames

UID = "6f1c2a4e-0000-4000-8000-000000000001"


def _done(uid: str = UID, **kw) -> TrainerOutcome:
    return new_outcome("job", uid, "Succeeded", "MaxStepsReached", step=3, policy_version=3, **kw)


# ------------------------------------------------------------------------------------ names


def test_the_uid_is_in_every_key_and_its_hash_tag():
    names = StreamNames.for_job("my-job", UID)
    keys = [*names.all_keys(), names.rollout_cursor("shared")]
    assert all(k.startswith(f"asyncrl:{{my-job/{UID}}}:") for k in keys)
    assert names.outcome in names.all_keys()
    assert len(set(keys)) == len(keys)
    # Another uid (the job deleted and re-created under the same name) shares no key.
    other = StreamNames.for_job("my-job", "6f1c2a4e-0000-4000-8000-000000000002")
    assert not set(keys) & {*other.all_keys(), other.rollout_cursor("shared")}
    # Without a uid (local runs) the names are what they always were.
    assert StreamNames.for_job("my-job").trajectories == "asyncrl:{my-job}:trajectories"
    for bad in ("a/b", "a{b", "a}b", "a b"):
        with pytest.raises(ValueError):
            StreamNames.for_job("my-job", bad)


def test_runtime_reads_the_uid_and_names_keys_with_it(monkeypatch):
    monkeypatch.setenv("ASYNCRL_JOB_UID", UID)
    rt = Runtime.from_env()
    assert rt.job_uid == UID and rt.to_env()["ASYNCRL_JOB_UID"] == UID
    assert rt.stream_names("j") == StreamNames.for_job("j", UID)
    assert "ASYNCRL_JOB_UID" not in Runtime().to_env()


# ------------------------------------------------------------------------------------ Redis record


async def test_the_first_outcome_wins(transport_redis):
    names = StreamNames.for_job("job", UID)
    assert await read_outcome_redis(transport_redis, names) is None
    first = _done()
    assert await write_outcome_redis(transport_redis, names, first) is True
    later = new_outcome("job", UID, "Failed", "WeightSyncFailed", message="late")
    assert await write_outcome_redis(transport_redis, names, later) is False
    assert await read_outcome_redis(transport_redis, names) == first
    # Another uid of the same job name has its own record.
    assert await read_outcome_redis(transport_redis, StreamNames.for_job("job", "other-uid")) is None


async def test_an_unreadable_redis_record_is_no_outcome(transport_redis, redis_url):
    names = StreamNames.for_job("job", UID)
    for raw in (b"not json", b'{"job": "job"}', b"\xff\xfe", b'{"phase": "Done", "job": "j", "reason": "x"}'):
        await transport_redis.set(names.outcome, raw)
        assert await read_outcome_redis(transport_redis, names) is None
    import redis as redis_lib

    sync = redis_lib.Redis.from_url(redis_url)
    try:
        assert read_outcome_redis_sync(sync, names) is None
        outcome = _done()
        sync.set(names.outcome, outcome.to_json())
        assert read_outcome_redis_sync(sync, names) == outcome
    finally:
        sync.close()


def test_round_trip_keeps_the_report():
    outcome = _done(report={"phase": "Succeeded", "step": 3, "reward_mean": 0.5}, weights_path="/w/v3")
    assert TrainerOutcome.from_json(outcome.to_json()) == outcome
    assert outcome.report_fields() == {"phase": "Succeeded", "message": "", "reason": "MaxStepsReached",
                                       "step": 3, "policy_version": 3, "final_weights": "/w/v3"}
    assert outcome.summary.startswith("Succeeded (MaxStepsReached) at step 3")


# ------------------------------------------------------------------------------------ file record


def test_the_file_record_is_atomic_and_keyed_by_uid(tmp_path: Path):
    assert read_outcome_file(tmp_path, UID) is None
    outcome = _done()
    path = write_outcome_file(tmp_path / "weights", outcome)
    assert path.name == OUTCOME_FILE and [p.name for p in path.parent.iterdir()] == [OUTCOME_FILE]
    assert read_outcome_file(tmp_path / "weights", UID) == outcome
    assert read_outcome_file(tmp_path / "weights", "another-uid") is None  # a re-created job's volume
    assert read_outcome_file(tmp_path / "weights", "") is None


@pytest.mark.parametrize("content", [b"", b"{", b"\xff\xfe\x00", b'{"job": 1}', b"[]"])
def test_an_unreadable_file_is_no_outcome(tmp_path: Path, content: bytes):
    (tmp_path / OUTCOME_FILE).write_bytes(content)
    assert read_outcome_file(tmp_path, UID) is None


# ------------------------------------------------------------------------------------ termination log


def test_termination_message_goes_where_configured(tmp_path: Path, monkeypatch):
    target = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(target))
    assert termination_log_path() == target
    assert write_termination_message("x" * 5000 + "END") is True
    text = target.read_text()
    assert len(text) == 4000 and text.endswith("END")  # the end of a long message is kept
    # Outside Kubernetes (no /dev/termination-log) and without the variable: nothing is written.
    monkeypatch.delenv(ENV_TERMINATION_LOG)
    if not Path("/dev/termination-log").exists():
        assert termination_log_path() is None and write_termination_message("nothing") is False
    assert write_termination_message("no such dir", tmp_path / "missing" / "log") is False
