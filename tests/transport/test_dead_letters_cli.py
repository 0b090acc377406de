"""`asyncrl dead-letters`: the groups a trainer refused, read back from a real Redis by the real CLI."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl.api.stream_names import StreamNames
from asyncrl.cli import main as cli_main
from asyncrl.transport.streams import EPISODE_FAILED, REWARD_FAILED, TrajectoryConsumer, TrajectoryProducer
from asyncrl.transport.wire import decode_group

JOB, UID = "poisoned", "0b6c1f9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
NAMES = StreamNames.for_job(JOB, UID)


async def test_lists_each_refused_group_with_its_reason_as_json_and_saves_the_payloads(
        transport_redis, redis_url, make_trajectory_group, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    garbage = b"\x00not msgpack at all"
    poison = make_trajectory_group("g-nan", job=JOB)
    lps = np.array(poison.samples[0].behav_logprobs, dtype=np.float32)
    lps[1] = math.nan
    poison.samples[0].behav_logprobs = lps
    await transport_redis.xadd(NAMES.trajectories, {b"data": garbage, b"gid": b"g-garbage"})
    await TrajectoryProducer(transport_redis, NAMES).publish(poison)
    consumer = TrajectoryConsumer(transport_redis, NAMES, "trainer-0")
    assert await consumer.read(count=10, block_ms=100) == []
    assert consumer.stats.dead_lettered == 2
    unscored = make_trajectory_group("g-unscored", job=JOB)
    await TrajectoryProducer(transport_redis, NAMES).dead_letter_refused(
        unscored, REWARD_FAILED, "1 of 2 rewards failed: ConnectionError: verifier down", "rollout-0")
    failed = make_trajectory_group("g-failed-episode", job=JOB)
    await TrajectoryProducer(transport_redis, NAMES).dead_letter_refused(
        failed, EPISODE_FAILED, "episode my:agent failed (3 tries): KeyError: 'x'", "rollout-0")

    code = await asyncio.to_thread(cli_main, ["dead-letters", JOB, "--uid", UID, "--redis-url", redis_url, "--json",
                     "--save", str(tmp_path / "payloads")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and (out["job"], out["total"], out["shown"]) == (JOB, 4, 4)
    assert out["by_kind"] == {"undecodable": 1, "untrainable": 1, "reward failed": 1, "episode failed": 1}
    first, second, third, fourth = out["dead_letters"]
    assert (fourth["kind"], fourth["group_id"], fourth["reason"]) == \
        ("episode failed", "g-failed-episode", "episode failed: episode my:agent failed (3 tries): KeyError: 'x'")
    assert (third["kind"], third["group_id"], third["consumer"], third["source_entry"]) == \
        ("reward failed", "g-unscored", "rollout-0", "")
    assert third["reason"].endswith("verifier down")
    assert (first["kind"], first["group_id"], first["consumer"]) == ("undecodable", None, "trainer-0")
    assert (second["kind"], second["group_id"], second["prompt_id"]) == ("untrainable", "g-nan", "prompt-g-nan")
    assert "logprob" in second["reason"] and second["reason"].startswith("untrainable")
    saved = {p.stem: p.read_bytes() for p in (tmp_path / "payloads").iterdir()}
    assert saved[first["entry_id"]] == garbage
    assert decode_group(saved[second["entry_id"]]).group_id == "g-nan"

    assert await asyncio.to_thread(cli_main, ["dead-letters", JOB, "--uid", UID, "--redis-url", redis_url,
                                              "--count", "1"]) == 0
    table = capsys.readouterr().out
    assert "undecodable" in table and "4 dead letter(s) in total; shown 1: 1 undecodable" in table

    # without the uid: the keys of a local run of that name, which has none
    assert await asyncio.to_thread(cli_main, ["dead-letters", JOB, "--redis-url", redis_url]) == 0
    assert capsys.readouterr().out.strip() == f"job {JOB}: no dead letters"


def test_an_unreachable_redis_is_a_clear_error_not_a_traceback(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "dead-letters", JOB,
                           "--redis-url", f"redis://127.0.0.1:{port}/0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and f"127.0.0.1:{port}" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "dead-letters", JOB, "--redis-url", "http://x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "redis://" in bad.stderr
