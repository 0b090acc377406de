"""Weight-version channel and engine registry against a real Redis server."""

from __future__ import annotations

import asyncio
import time

from asyncrl.transport.names import StreamNames
from asyncrl.transport.versions import EngineInfo, EngineRegistry, VersionChannel, VersionEvent

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
