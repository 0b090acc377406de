"""Outages are ridden out (issue 15, item 5), against a real Redis server stopped and restarted.

Measured before: a Redis outage longer than ~10 s crashed the trainer and every rollout worker
(redis-py gave up after a fixed 10 retries), and an engine outage longer than a few retries dropped
the worker's groups. Now every Redis command waits out an outage window (default 180 s) with capped,
jittered exponential backoff, the worker waits for an unreachable engine the same way, and the
process says it is Degraded meanwhile (the Health board: the worker's log line, the trainer's
/status). The Redis outages below last OUTAGE_S, longer than the old policy's whole retry budget.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.local.redis_server import LocalRedis
from asyncrl.rollout.data.datasets import ArithmeticSource, PromptItem
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect, make_client
from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer
from asyncrl.transport.wire import decode_group
from tests.support.jobs import JobBuilder
from tests.support.polling import poll
from tests.support.sglang_fake import FakeSGLang, ServerThread, create_app

OUTAGE_S = 15.0
"""Longer than the old policy (10 retries, backoff capped at 2 s) can wait: it gave up after
11-13 s in every measurement (~10 s in the issue's), so the old code fails these tests."""
NAMES = StreamNames.for_job("outage")


def health_board() -> Any:
    """The process-wide board, emptied (imported here: the tests above it must also run, and
    fail for the right reason, on code that has no board)."""
    from asyncrl.infra.health import HEALTH

    HEALTH.clear()
    return HEALTH


def failures(tasks: dict[str, asyncio.Task]) -> dict[str, str]:
    """Tasks that already ended with an error, by name (they should all still be waiting)."""
    return {name: repr(t.exception()) for name, t in tasks.items() if t.done() and t.exception() is not None}


async def test_publish_read_and_ack_started_during_an_outage_complete_after_it(
        redis_server: LocalRedis, make_trajectory_group: Any) -> None:
    """The trainer's and the workers' commands (XADD, XREADGROUP, the ack script) issued while
    Redis is down block until it is back and then complete; a client with the old fixed retry
    budget fails in the same outage. /status says Degraded meanwhile, and not after."""
    from asyncrl.api.status_report import TrainerReport
    from asyncrl.trainer.report.status_api import create_app as status_app

    board = health_board()
    client = await connect(redis_server.url)  # the default policy: the outage window
    old = make_client(redis_server.url, retries=10)  # the old budget: 10 retries, then raise
    producer = TrajectoryProducer(client, NAMES)
    consumer = TrajectoryConsumer(client, NAMES, "trainer-0")
    await consumer.ensure_group()
    await producer.publish(make_trajectory_group("before"))
    [delivered] = await consumer.read(count=1, block_ms=100)
    await old.ping()
    app = status_app(lambda: TrainerReport(job="outage"), health=board)
    status = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer")

    redis_server.stop()
    started = time.monotonic()
    tasks = {"publish": asyncio.create_task(producer.publish(make_trajectory_group("during"))),
             "ack": asyncio.create_task(consumer.ack([delivered])),
             "read": asyncio.create_task(consumer.read(count=1, block_ms=1000))}
    old_task = asyncio.create_task(old.set("old-policy", "v"))
    await asyncio.sleep(OUTAGE_S)

    assert not failures(tasks), f"commands gave up during a {OUTAGE_S:.0f}s outage: {failures(tasks)}"
    assert not any(t.done() for t in tasks.values())  # still waiting, not failed
    assert old_task.done() and isinstance(old_task.exception(), RedisConnectionError)  # the old budget is spent
    assert board.degraded() and board.outages()[0].target == f"127.0.0.1:{redis_server.port}/0"
    body = (await status.get("/status")).json()
    assert body["degraded"]["status"] is True and body["degraded"]["reason"] == "RedisUnavailable"
    assert f":{redis_server.port}" in body["degraded"]["message"]
    assert body["degraded"]["outages"][0]["seconds"] >= OUTAGE_S - 1
    assert body["job"] == "outage"  # the report itself is still served

    redis_server.start()
    results = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 60)))
    assert time.monotonic() - started >= OUTAGE_S
    assert results["ack"] == []  # acknowledged: "before" is marked trained, no double train
    assert await client.zscore(NAMES.trained, "before") is not None
    later = await consumer.read(count=5, block_ms=100)
    got = [d.group.group_id for d in results["read"] + later]
    assert got == ["during"]  # published during the outage, read once
    entries = await client.xrange(NAMES.trajectories)
    assert [decode_group(f[b"data"]).group_id for _, f in entries] == ["during"]

    assert not board.degraded()
    assert "degraded" not in (await status.get("/status")).json()
    await status.aclose()
    await old.aclose()
    await client.aclose()


def render(item: PromptItem) -> list[int]:
    return [ord(c) % 200 + 3 for c in item.question][:12]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def make_worker(redis: Any, engine_url: str, *, max_groups: int, engine_outage_s: float = 180.0,
                health: Any = None) -> RolloutWorker:
    cfg = WorkerConfig(job=NAMES.job, engine_id="pod-0", group_size=2, engine_url=engine_url,
                       sampling=SamplingParams(max_new_tokens=4), max_concurrent_requests=4,
                       max_retries=2, backoff_s=0.01, backoff_max_s=0.5, heartbeat_s=0.2, log_every_s=60,
                       max_groups=max_groups, engine_outage_s=engine_outage_s)
    admission = Admission(redis, NAMES, batch_size=4, staleness=StalenessPolicy.global_budget(100), max_concurrent=4,
                          lease_seconds=60)
    extra = {} if health is None else {"health": health}
    prompts = Mixture.single(ArithmeticSource(seed=0, difficulty=1), render, RewardScorer(exact_number_reward, 5.0))
    return RolloutWorker(cfg, engine=SGLangEngine(engine_url), redis=redis, prompts=prompts, decode=decode,
                         admission=admission, names=NAMES, **extra)


async def test_a_rollout_worker_rides_out_a_redis_outage(redis_server: LocalRedis) -> None:
    """A worker whose Redis goes away for longer than the old budget keeps its groups waiting
    (lease, cursor, XADD) and publishes every one of them once Redis is back; it does not crash."""
    health_board()
    fake = FakeSGLang(token_delay=0.02).start()
    redis = await connect(redis_server.url)
    try:
        worker = make_worker(redis, fake.url, max_groups=6)
        run = asyncio.create_task(worker.run())
        await poll(lambda: worker.stats.groups_published >= 1, what="a first group")
        redis_server.stop()
        await asyncio.sleep(OUTAGE_S)
        assert not run.done(), f"the worker ended during the outage: {run.exception() if run.done() else ''}"
        assert "degraded=redis(" in worker.summary()
        redis_server.start()
        stats = await asyncio.wait_for(run, 120)
        assert stats.groups_published == 6 and stats.groups_dropped == 0
        entries = await redis.xrange(NAMES.trajectories)
        assert len({decode_group(f[b"data"]).prompt_id for _, f in entries}) == 6
        assert "degraded=no" in worker.summary()
    finally:
        fake.stop()
        await redis.aclose()


async def test_a_rollout_worker_waits_for_its_engine_instead_of_dropping_groups(redis_url: str) -> None:
    """The engine goes away (its server restarts on the same address) while groups are being
    generated: the samples wait for it (Degraded: EngineUnavailable) and every group is published
    after it is back; before, each sample gave up after `max_retries` and its group was dropped."""
    board = health_board()
    fake = FakeSGLang(token_delay=0.02).start()
    restarted: ServerThread | None = None
    redis = await connect(redis_url)
    try:
        worker = make_worker(redis, fake.url, max_groups=6, health=board)
        run = asyncio.create_task(worker.run())
        await poll(lambda: worker.stats.groups_published >= 1, what="a first group")
        fake.stop()  # in-flight answers finish, then nothing listens at the engine's address
        await poll(lambda: board.is_failing("engine", fake.url), what="the engine outage to be seen")
        assert board.condition()["reason"] == "EngineUnavailable"
        assert "degraded=engine(" in worker.summary()
        await asyncio.sleep(2.0)  # many retries' worth of the old budget (2 retries, 0.01 s backoff)
        assert not run.done() and worker.stats.groups_dropped == 0
        restarted = ServerThread(create_app(fake.state), port=fake.port).start()
        stats = await asyncio.wait_for(run, 120)
        assert stats.groups_published == 6 and stats.groups_dropped == 0
        assert not board.degraded() and "degraded=no" in worker.summary()
    finally:
        (restarted or fake).stop()
        await redis.aclose()


async def test_an_engine_that_is_not_there_gets_no_lease(redis_url: str) -> None:
    """A worker whose engine does not answer takes no admission lease (it could generate nothing)
    and starts no group: it waits, Degraded, until the engine answers or it is stopped. (A group
    whose engine goes away mid-generation for longer than the window is generated again:
    tests/trainer/weights/test_engine_rejoin.py.)"""
    from asyncrl.infra.health import Health

    board = Health()
    fake = FakeSGLang()
    url = fake.url  # never started: nothing listens there
    redis = await connect(redis_url)
    try:
        worker = make_worker(redis, url, max_groups=1, engine_outage_s=0.3, health=board)
        run = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 30
        while not board.is_failing("engine", url):
            assert time.monotonic() < deadline, "the worker never reported its engine failing"
            await asyncio.sleep(0.01)
        snap = await worker.admission.snapshot()
        assert snap.running == 0 and snap.accepted == 0
        worker.stop()
        stats = await asyncio.wait_for(run, 30)
        assert stats.groups_published == 0 and stats.groups_dropped == 0 and stats.requests == 0
        assert board.is_failing("engine", url)
    finally:
        await redis.aclose()


async def test_past_the_window_a_command_fails_and_stays_degraded() -> None:
    """The window is a bound, not a promise to wait forever: a Redis that stays away fails the
    command after it (the component then restarts), and the board still says Degraded."""
    from asyncrl.infra.health import Health
    from asyncrl.infra.net import free_port

    board, window = Health(), 0.5
    client = make_client(f"redis://127.0.0.1:{free_port()}/0", outage_s=window, health=board)
    try:
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(client.ping(), 30)
        [outage] = board.outages()
        assert outage.dependency == "redis" and outage.window_s == window and outage.failures >= 2
        assert board.condition()["status"] is True
    finally:
        await client.aclose()


@pytest.mark.slow
def test_the_trainer_rides_out_a_redis_outage_without_losing_a_step(tmp_path: Path, redis_server: LocalRedis) -> None:
    """The trainer process (the real CLI, real model) finishes step 1 and waits for its next batch
    when Redis goes away for longer than the old budget: it stays up, /status says Degraded
    (RedisUnavailable) meanwhile, and once Redis is back it trains step 2 and commits both. Step 1
    was never checkpointed before the outage (checkpointInterval 10): before, the trainer crashed
    and the restarted one trained it again from the last checkpoint."""
    from asyncrl.infra.net import free_port
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

    job, uid, url = "t-outage", "7d1f3c2a-0000-4000-8000-000000000015", redis_server.url
    job_file = JobBuilder.small(name=job, batch_size=2, group_size=2, max_steps=2,
                                checkpoint_interval=10).write(tmp_path / "job.yaml")
    groups = make_groups(job, 4, group_size=2)
    publish(url, job, groups[:2], uid=uid)
    port, log = free_port(), tmp_path / "trainer.log"
    cmd = ASYNCRL + ["trainer", "--config", str(job_file), "--threads", "1", "--status-port", str(port),
                     "--status-host", "127.0.0.1"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=trainer_env(tmp_path, url, uid=uid), cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT)

    def status() -> dict[str, Any]:
        try:
            return dict(httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json())
        except (httpx.HTTPError, ValueError):
            return {}

    def alive() -> None:
        assert proc.poll() is None, f"trainer exited ({proc.returncode})\n{log.read_text()[-3000:]}"

    try:
        deadline = time.monotonic() + 400
        while not (status().get("step") == 1 and status().get("phase") == "Waiting"):
            alive()
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        redis_server.stop()
        seen: dict[str, Any] = {}
        outage_end = time.monotonic() + OUTAGE_S
        while time.monotonic() < outage_end:
            alive()
            seen = status().get("degraded") or seen
            time.sleep(0.5)
        alive()
        assert seen.get("status") is True and seen.get("reason") == "RedisUnavailable", seen
        redis_server.start()
        publish(url, job, groups[2:], uid=uid)
        outcome = wait_for_outcome(url, job, proc, uid=uid, log=log)
        assert (outcome.phase, outcome.step) == ("Succeeded", 2)
        assert outcome.report is not None and outcome.report["groups_trained"] == 4
        assert "degraded" not in status()
    finally:
        stop_trainer(proc)
    text = log.read_text()
    assert "resumed from" not in text and "trainer crashed" not in text
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]  # each step once

    async def trained(r: Any) -> set[str]:
        from asyncrl.api.stream_names import StreamNames
        from asyncrl.transport.streams import trained_ids

        return await trained_ids(r, StreamNames.for_job(job, uid))

    assert redis_query(url, trained) == {g.group_id for g in groups}
