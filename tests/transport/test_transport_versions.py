"""Weight-version channel and engine registry against a real Redis server."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

from asyncrl.api.stream_names import StreamNames
from asyncrl.api.weight_labels import WeightLabel
from asyncrl.transport.versions import EngineInfo, EngineRegistry, EngineWeights, VersionChannel, VersionEvent

NAMES = StreamNames.for_job("job")


async def test_latest_and_wait_newer(transport_redis):
    channel = VersionChannel(transport_redis, NAMES)
    assert await channel.latest() is None
    assert await channel.wait_newer(0, timeout=0.05) is None
    await channel.publish(VersionEvent(1, "/weights/v1", 10.0))
    assert await channel.latest() == VersionEvent(1, "/weights/v1", 10.0)
    assert (await channel.wait_newer(0, timeout=1)).version == 1  # already there: no wait
    assert await channel.wait_newer(1, timeout=0.05) is None

    waiter = asyncio.create_task(channel.wait_newer(1, timeout=30))
    await asyncio.sleep(0)  # let it start blocking, then publish two versions
    await channel.publish(VersionEvent(2, "/weights/v2", 11.0))
    await channel.publish(VersionEvent(3, "/weights/v3", 12.0))
    event = await waiter
    assert event.version in (2, 3) and event.weights_path == f"/weights/v{event.version}"
    assert (await channel.latest()).version == 3


async def test_wait_newer_does_not_miss_an_event_published_after_the_check(transport_redis):
    channel = VersionChannel(transport_redis, NAMES)
    await channel.publish(VersionEvent(5, "/w/5", 1.0))
    results = await asyncio.gather(channel.wait_newer(5, timeout=30),
                                   channel.publish(VersionEvent(6, "/w/6", 2.0)))
    assert results[0].version == 6


async def test_engine_registry(transport_redis):
    registry = EngineRegistry(transport_redis, NAMES)
    now = time.time()
    await registry.register(EngineInfo("e1", "http://e1:30000", 3, True, now))
    await registry.register(EngineInfo("e0", "http://e0:30000", None, False, now))
    await registry.register(EngineInfo("old", "http://old:30000", 1, True, now - 120))
    await transport_redis.hset(NAMES.engines, "corrupt", "{not json")
    assert [e.engine_id for e in await registry.list()] == ["e0", "e1"]
    assert (await registry.list())[1] == EngineInfo("e1", "http://e1:30000", 3, True, now)
    assert len(await registry.list(max_age_s=300)) == 3
    await registry.remove("e1")
    assert [e.engine_id for e in await registry.list()] == ["e0"]


async def test_trainer_record_of_engine_weights(transport_redis):
    """The trainer's record (begin/end of an update) and how list() merges it with the heartbeat."""
    registry = EngineRegistry(transport_redis, NAMES)
    assert await registry.weights("e0") is None
    t0 = time.time()
    await registry.register(EngineInfo("e0", "http://e0:30000", 0, True, t0))

    rec = await registry.begin_update("e0", 1, timeout_s=30)
    assert (rec.version, rec.updating, rec.epoch, rec.label) == (None, 1, 1, WeightLabel(0)) and rec.in_progress()
    assert (await registry.list())[0].weight_version == 0  # not loaded yet
    rec = await registry.end_update("e0", loaded=True)
    assert (rec.version, rec.updating, rec.epoch, rec.in_progress()) == (1, None, 1, False)
    assert await registry.weights("e0") == rec
    assert (await registry.list())[0].weight_version == 1  # newer than the worker's observation

    await registry.begin_update("e0", 2, timeout_s=30)
    rec = await registry.end_update("e0", loaded=False)  # a failed update keeps the version
    assert (rec.version, rec.updating, rec.epoch) == (1, None, 2)

    # an observation newer than the record wins (e.g. the engine restarted on its initial weights)
    await registry.register(EngineInfo("e0", "http://e0:30000", 0, True, time.time() + 1))
    assert (await registry.list())[0].weight_version == 0
    await registry.remove("e0")  # the worker leaves; the trainer's record stays
    assert (await registry.all_weights())["e0"].version == 1

    # a marker past its deadline (the trainer died mid-update) does not hold anyone
    assert not EngineWeights(version=1, updating=2, until=time.time() - 1).in_progress()

    # a later trainer timeline's label is recorded whole, and list() merges it whole
    await registry.register(EngineInfo("e0", "http://e0:30000", 1, True, time.time()))
    await registry.begin_update("e0", WeightLabel(3, 1), timeout_s=30)
    rec = await registry.end_update("e0", loaded=True)
    assert (rec.version, rec.timeline, rec.label) == (3, 1, WeightLabel(3, 1))
    assert (await registry.list())[0].weights() == WeightLabel(3, 1)


async def test_prune_forgets_engines_silent_too_long_and_their_records(transport_redis):
    """Pods replaced under new names (a Deployment's) leave entries nobody heartbeats: pruned after
    `older_than_s`, with the trainer's records of engines that no longer have an entry."""
    registry = EngineRegistry(transport_redis, NAMES)
    now = time.time()
    await registry.register(EngineInfo("live", "http://live:30000", 3, True, now))
    await registry.register(EngineInfo("gone", "http://gone:30000", 2, True, now - 7200))
    await transport_redis.hset(NAMES.engines, "corrupt", b"{not json")
    for engine_id, age in (("live", 7200), ("gone", 7200), ("orphan-old", 7200), ("orphan-new", 10)):
        await transport_redis.hset(NAMES.engine_weights, engine_id,
                                   json.dumps(asdict(EngineWeights(version=2, time=now - age))))
    assert await registry.prune(older_than_s=3600) == 4  # gone, corrupt; the records of gone and orphan-old
    assert set(await transport_redis.hkeys(NAMES.engines)) == {b"live"}
    assert set(await transport_redis.hkeys(NAMES.engine_weights)) == {b"live", b"orphan-new"}
    assert [e.engine_id for e in await registry.list(max_age_s=30)] == ["live"]
    assert await registry.prune(older_than_s=3600) == 0
