"""Trajectory streams against a real Redis server: delivery, dedupe, dead letters, crashes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.connection import connect
from asyncrl.transport.streams import (
    DATA_FIELD,
    GID_FIELD,
    TrajectoryConsumer,
    TrajectoryProducer,
    read_dead_letters,
    trained_ids,
)
from asyncrl.transport.wire import decode_group, encode_group
from tests.support.paths import REPO

NAMES = StreamNames.for_job("job")


async def drain(consumer: TrajectoryConsumer, *, batch: int = 10, idle_reads: int = 2) -> list:
    """Read until `idle_reads` consecutive reads return nothing (each blocks 100 ms)."""
    out, idle = [], 0
    while idle < idle_reads:
        got = await consumer.read(batch, 100)
        out += got
        idle = 0 if got else idle + 1
    return out


def gids(deliveries) -> list[str]:
    return [d.group.group_id for d in deliveries]


async def test_names_share_one_hash_tag():
    names = StreamNames.for_job("my-job")
    assert all("{my-job}" in k for k in names.all_keys())
    assert len(set(names.all_keys())) == len(names.all_keys())
    with pytest.raises(ValueError):
        StreamNames.for_job("bad{job}")


async def test_publish_read_ack_round_trip_and_stream_emptied(transport_redis, make_trajectory_group):
    r = transport_redis
    producer = TrajectoryProducer(r, NAMES)
    consumer = TrajectoryConsumer(r, NAMES, "trainer-0")
    await consumer.ensure_group()
    await consumer.ensure_group()  # idempotent
    sent = [make_trajectory_group(f"g{i}", n_tokens=i) for i in range(5)]
    ids = [await producer.publish(g) for g in sent]
    got = await consumer.read(10, 100)
    assert [d.entry_id for d in got] == ids
    for d, g in zip(got, sent):
        assert d.group.samples == g.samples and d.group.group_id == g.group_id
        assert d.group.published_at > 0  # stamped by publish
    assert await consumer.pending_count() == 5
    assert await consumer.ack(got) == []
    assert await consumer.pending_count() == 0
    assert await r.xlen(NAMES.trajectories) == 0  # acked entries deleted: memory bounded
    assert await trained_ids(r, NAMES) == {f"g{i}" for i in range(5)}
    assert await consumer.read(10, 50) == []


async def test_groups_published_before_the_group_exists_are_consumed(transport_redis, make_trajectory_group):
    await TrajectoryProducer(transport_redis, NAMES).publish(make_trajectory_group("early"))
    assert gids(await TrajectoryConsumer(transport_redis, NAMES, "t").read(5, 100)) == ["early"]


async def test_ack_never_deletes_unacked_entries(transport_redis, make_trajectory_group):
    """Acking a later entry trims (MINID) only below the oldest pending one; no MAXLEN."""
    r = transport_redis
    producer = TrajectoryProducer(r, NAMES)
    consumer = TrajectoryConsumer(r, NAMES, "t")
    for i in range(6):
        await producer.publish(make_trajectory_group(f"g{i}"))
    first = await consumer.read(3, 100)
    await consumer.ack(first[1:])  # g0 stays pending
    assert await r.xlen(NAMES.trajectories) == 4  # g0 pending + g3..g5 undelivered
    rest = await drain(consumer)
    assert gids(rest) == ["g3", "g4", "g5"]
    await consumer.ack(rest)
    # a restarted consumer still gets g0, the one entry it never acked
    again = TrajectoryConsumer(r, NAMES, "t")
    assert gids(await again.read(10, 50)) == ["g0"]


async def test_malformed_and_truncated_payloads_go_to_dead_letter(transport_redis, make_trajectory_group):
    r = transport_redis
    good = encode_group(make_trajectory_group("good"))
    bad_version = msgpack.packb({**msgpack.unpackb(good), "v": 2})
    bad = {"truncated": good[: len(good) // 2], "garbage": b"\x00\xff junk", "schema": bad_version}
    consumer = TrajectoryConsumer(r, NAMES, "t")
    await consumer.ensure_group()
    ids = {}
    for name, payload in bad.items():
        ids[name] = (await r.xadd(NAMES.trajectories, {GID_FIELD: name, DATA_FIELD: payload})).decode()
    ids["no-data"] = (await r.xadd(NAMES.trajectories, {"other": "x"})).decode()
    await TrajectoryProducer(r, NAMES).publish(make_trajectory_group("good"))
    got = await drain(consumer)
    assert gids(got) == ["good"]
    dead = {d.source_id: d for d in await read_dead_letters(r, NAMES)}
    assert set(dead) == set(ids.values())
    for name, payload in bad.items():
        assert dead[ids[name]].payload == payload  # raw bytes kept for inspection
        assert dead[ids[name]].error and dead[ids[name]].consumer == "t"
    assert "schema version 2" in dead[ids["schema"]].error
    assert "'data'" in dead[ids["no-data"]].error
    assert consumer.stats.dead_lettered == 4 and consumer.stats.undecodable == 3
    await consumer.ack(got)
    assert await consumer.pending_count() == 0 and await r.xlen(NAMES.trajectories) == 0


async def test_untrainable_group_goes_to_dead_letter_with_the_reason(transport_redis, make_trajectory_group):
    """A group that decodes but cannot be trained (issue 16: a NaN behaviour logprob) is never
    delivered: dead-lettered with the reason and its raw bytes, acked, counted."""
    r = transport_redis
    poison = make_trajectory_group("poison", n_samples=3)
    poison.samples[2].behav_logprobs = np.array([-0.5, -0.5, np.nan, -0.5], dtype=np.float32)
    producer = TrajectoryProducer(r, NAMES)
    poison_id = await producer.publish(poison)
    await producer.publish(make_trajectory_group("good"))
    consumer = TrajectoryConsumer(r, NAMES, "t")
    got = await drain(consumer)
    assert gids(got) == ["good"]
    [dead] = await read_dead_letters(r, NAMES)
    assert dead.source_id == poison_id and dead.consumer == "t"
    assert dead.error == "untrainable: group 'poison': sample 2: behav_logprobs[2] is NaN"
    assert decode_group(dead.payload).group_id == "poison"
    assert (consumer.stats.dead_lettered, consumer.stats.untrainable, consumer.stats.undecodable) == (1, 1, 0)
    await consumer.ack(got)
    assert await consumer.pending_count() == 0 and await r.xlen(NAMES.trajectories) == 0
    assert await trained_ids(r, NAMES) == {"good"}  # dead-lettered, not trained


async def test_producer_retry_duplicates_are_trained_once(transport_redis, make_trajectory_group):
    """A publish retried after a lost reply leaves two copies: same read, later read, after ack."""
    r = transport_redis
    producer = TrajectoryProducer(r, NAMES)
    consumer = TrajectoryConsumer(r, NAMES, "t")
    # both copies inside one read
    for gid in ["a", "a", "b"]:
        await producer.publish(make_trajectory_group(gid))
    first = await consumer.read(10, 100)
    assert gids(first) == ["a", "b"]
    # a copy arriving while the original is still in flight (read, not yet acked)
    await producer.publish(make_trajectory_group("b"))
    assert await consumer.read(10, 100) == []
    await consumer.ack(first)
    # a copy arriving after the original was trained
    await producer.publish(make_trajectory_group("a"))
    assert await consumer.read(10, 100) == []
    assert consumer.stats.duplicates_skipped == 3
    assert await consumer.pending_count() == 0 and await r.xlen(NAMES.trajectories) == 0
    # a fresh consumer (no in-flight memory) also skips copies of trained groups
    await producer.publish(make_trajectory_group("b"))
    assert await TrajectoryConsumer(r, NAMES, "other").read(10, 100) == []


async def test_reclaiming_own_inflight_entry_does_not_deliver_it_twice(transport_redis, make_trajectory_group):
    r = transport_redis
    await TrajectoryProducer(r, NAMES).publish(make_trajectory_group("x"))
    consumer = TrajectoryConsumer(r, NAMES, "t")
    got = await consumer.read(1, 100)
    assert gids(got) == ["x"]
    assert await consumer.reclaim(min_idle_ms=0) == []
    assert await consumer.pending_count() == 1  # still pending, still ours
    await consumer.ack(got)
    assert await consumer.pending_count() == 0


CONSUMER_SCRIPT = r"""
import asyncio, json, sys
from asyncrl.transport.connection import connect
from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.streams import TrajectoryConsumer

async def main(url, name, count):
    r = await connect(url)
    c = TrajectoryConsumer(r, StreamNames.for_job("job"), name)
    got = []
    while len(got) < count:
        got += await c.read(count - len(got), 1000)
    print(json.dumps([d.group.group_id for d in got]), flush=True)
    await asyncio.Event().wait()  # "training" forever: killed before it acks

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def run_and_kill_consumer(url: str, name: str, count: int) -> list[str]:
    """A consumer process reads `count` groups, reports them, and is SIGKILLed before acking."""
    # asyncrl is installed (editable) in the venv; run outside the repo root, whose operator/
    # folder would shadow the stdlib `operator` module for `python -c`
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, url, name, str(count)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO / "tests")
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line, proc.stderr.read().decode()
        return json.loads(line)
    finally:
        proc.kill()  # SIGKILL
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("recovery", ["restart-same-name", "reclaim-by-other"])
async def test_consumer_killed_between_read_and_ack(recovery, transport_redis, redis_url, make_trajectory_group):
    r = transport_redis
    producer = TrajectoryProducer(r, NAMES)
    all_gids = [f"g{i}" for i in range(8)]
    for gid in all_gids:
        await producer.publish(make_trajectory_group(gid))
    taken = await run_and_kill_consumer(redis_url, "trainer-0", 5)
    assert taken == all_gids[:5]
    assert await r.xlen(NAMES.trajectories) == 8  # nothing lost by the crash

    trained: list[str] = []
    if recovery == "restart-same-name":
        restarted = TrajectoryConsumer(r, NAMES, "trainer-0")
        first = await restarted.read(3, 100)
        assert gids(first) == taken[:3]  # own pending entries first, in order
        await restarted.ack(first)
        rest = await drain(restarted)
        await restarted.ack(rest)
        trained = gids(first) + gids(rest)
        # nobody else can reclaim anything any more
        assert await TrajectoryConsumer(r, NAMES, "other").reclaim(min_idle_ms=0) == []
    else:
        other = TrajectoryConsumer(r, NAMES, "trainer-1")
        reclaimed = await other.reclaim(min_idle_ms=0)
        assert gids(reclaimed) == taken
        new = await drain(other)
        await other.ack(reclaimed + new)
        trained = gids(reclaimed) + gids(new)
        # the dead consumer's name, restarted later, finds its pending list empty
        assert await TrajectoryConsumer(r, NAMES, "trainer-0").read(10, 50) == []
    assert sorted(trained) == sorted(all_gids) and len(trained) == len(set(trained))
    assert await r.zcard(NAMES.trained) == 8
    assert await r.xlen(NAMES.trajectories) == 0


@pytest.mark.slow
async def test_redis_killed_and_restarted_with_aof_mid_stream(redis_server, make_trajectory_group):
    """SIGKILL Redis while a producer publishes: nothing acked comes back, nothing unacked is lost."""
    r = await connect(redis_server.url)
    await r.config_set("appendfsync", "always")  # everysec may lose the last second on SIGKILL
    producer = TrajectoryProducer(r, NAMES)
    consumer = TrajectoryConsumer(r, NAMES, "trainer-0")
    published = [f"pre{i}" for i in range(10)]
    for gid in published:
        await producer.publish(make_trajectory_group(gid))
    delivered = await consumer.read(6, 100)
    acked_before = gids(delivered[:3])
    await consumer.ack(delivered[:3])  # 3 trained, 3 pending, 4 never delivered

    during: list[str] = []

    async def keep_publishing():
        for i in range(200):
            gid = f"mid{i}"
            await producer.publish(make_trajectory_group(gid))  # retried across the outage
            during.append(gid)

    task = asyncio.create_task(keep_publishing())
    deadline = time.monotonic() + 30
    while len(during) < 5 and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert not task.done() and len(during) >= 5, "the kill must land while the producer publishes"
    redis_server.stop(kill=True)
    redis_server.start()  # same port and data dir: replays the AOF
    await asyncio.wait_for(task, 60)
    assert len(during) == 200

    restarted = TrajectoryConsumer(r, NAMES, "trainer-0")  # same client: reconnects by itself
    after = await drain(restarted, batch=50)
    trained = acked_before + gids(after)
    await restarted.ack(after)
    assert await r.xlen(NAMES.trajectories) == 0
    assert not set(acked_before) & set(trained[3:]), "an acked group was redelivered"
    assert sorted(trained) == sorted(published + during), "a group was lost or duplicated"
    assert len(trained) == len(set(trained))
    await r.aclose()


async def test_consumer_recreates_a_vanished_group(transport_redis, make_trajectory_group):
    """Redis that lost its data (no AOF) must not wedge the trainer with NOGROUP errors."""
    r = transport_redis
    consumer = TrajectoryConsumer(r, NAMES, "t")
    await consumer.ensure_group()
    await r.delete(NAMES.trajectories)
    await TrajectoryProducer(r, NAMES).publish(make_trajectory_group("after"))
    assert gids(await consumer.read(5, 100)) == ["after"]


async def test_decoded_payload_matches_what_was_published(transport_redis, make_trajectory_group):
    r = transport_redis
    g = make_trajectory_group("big", n_samples=8, n_tokens=1024)
    entry_id = await TrajectoryProducer(r, NAMES).publish(g)
    [(_, fields)] = await r.xrange(NAMES.trajectories, entry_id, entry_id)
    assert fields[GID_FIELD] == b"big"
    assert decode_group(fields[DATA_FIELD]).samples == g.samples


async def test_trained_ids_are_pruned_once_no_copy_can_be_left(transport_redis, make_trajectory_group,
                                                               monkeypatch: pytest.MonkeyPatch):
    """Bounded memory: the trained ids are pruned by entry time relative to the stream's oldest entry
    (retention shortened here to 1.5 s; an hour in production)."""
    import asyncrl.transport.streams as streams

    monkeypatch.setattr(streams, "TRAINED_RETENTION_MS", 1500)
    r, producer = transport_redis, TrajectoryProducer(transport_redis, NAMES)
    trainer, other = TrajectoryConsumer(r, NAMES, "trainer-0"), TrajectoryConsumer(r, NAMES, "trainer-1")
    await producer.publish(make_trajectory_group("held"))
    held = await other.read(1, 100)
    assert gids(held) == ["held"]  # pending under another consumer: still in the stream
    await producer.publish(make_trajectory_group("g1"))
    await producer.publish(make_trajectory_group("g1"))  # a retried publish: a copy
    first = await trainer.read(1, 100)
    await trainer.ack(first)
    await asyncio.sleep(3.0)  # g1's entry is now older than the retention
    await producer.publish(make_trajectory_group("g2"))
    rest = await drain(trainer)
    assert gids(rest) == ["g2"] and trainer.stats.duplicates_skipped == 1  # the copy: skipped, not trained
    await trainer.ack(rest)
    # 'held' (older than g1) is still in the stream, so g1's id is kept: a copy could still be there
    assert await trained_ids(r, NAMES) == {"g1", "g2"}
    await other.ack(held)
    assert await r.xlen(NAMES.trajectories) == 0
    # the stream is empty now: the ids of entries older than now - retention are gone
    assert await trained_ids(r, NAMES) == {"g2"}


async def test_the_dead_letter_stream_keeps_only_the_newest(transport_redis, monkeypatch: pytest.MonkeyPatch):
    """Bounded memory: dead letters are capped (MAXLEN ~, so Redis trims whole nodes of up to 100
    entries; the cap is shortened to 10 here), the newest kept."""
    import asyncrl.transport.streams as streams

    monkeypatch.setattr(streams, "DEAD_LETTER_MAXLEN", 10)
    r = transport_redis
    consumer = TrajectoryConsumer(r, NAMES, "t")
    await consumer.ensure_group()
    for i in range(400):
        last = await r.xadd(NAMES.trajectories, {GID_FIELD: f"junk-{i}", DATA_FIELD: b"\x00 not msgpack"})
    while await r.xlen(NAMES.trajectories):  # (each read dead-letters up to 100 and delivers nothing)
        await consumer.read(100, 10)
    assert consumer.stats.dead_lettered == 400
    kept = await r.xlen(NAMES.dead_letter)
    assert 10 <= kept <= 10 + 100
    newest = (await r.xrevrange(NAMES.dead_letter, count=1))[0][1]
    assert newest[b"source_id"] == last and newest[b"error"]
