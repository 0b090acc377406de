"""Evaluation requests and results (asyncrl.transport.evaluation) against a real Redis server."""

from __future__ import annotations

import time
from typing import Any

import pytest

from asyncrl.api.status_report import EvalRecord
from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.evaluation import EVALUATORS_GROUP, EvalChannel

NO_TAKEOVER_MS = 3_600_000
"""An idle time no request reaches in a test: claims made with it never take over."""
LEFT_IDLE_MS = 60_000
"""How long a dead worker has left its request, set on Redis's own clock (XCLAIM IDLE): no waiting."""
TAKEOVER_MS = 30_000
"""The idle time the takeover tests claim with: half of LEFT_IDLE_MS, so a touched request stays
untakeable unless 30 s pass between the touch and the claim (no machine is that loaded)."""


@pytest.fixture
async def channel(transport_redis) -> EvalChannel:
    ch = EvalChannel(transport_redis, StreamNames.for_job("evtest"))
    await ch.ensure_group()
    await ch.ensure_group()  # idempotent (every worker calls it at start)
    return ch


def record(version: int, reward: float = 0.5) -> EvalRecord:
    return EvalRecord(policy_version=version, reward_mean=reward, pass_at_1=reward, k=1, prompts=4, samples=4,
                      engine_id="pod-0", time=time.time())


async def claim(ch: EvalChannel, consumer: str, *, min_idle_ms: int = NO_TAKEOVER_MS):
    return await ch.claim(consumer, block_ms=10, min_idle_ms=min_idle_ms)


async def pending(ch: EvalChannel) -> dict[int, str]:
    """version -> consumer holding it."""
    rows: Any = await ch.redis.xpending_range(ch.names.eval_requests, EVALUATORS_GROUP, min="-", max="+",
                                              count=100)
    return {int(r["message_id"].decode().split("-")[0]): r["consumer"].decode() for r in rows}


async def idle_ms(ch: EvalChannel, version: int) -> int:
    rows = await ch.redis.xpending_range(ch.names.eval_requests, EVALUATORS_GROUP, min=f"{version}-1",
                                         max=f"{version}-1", count=1)
    return int(rows[0]["time_since_delivered"])


async def left_idle(ch: EvalChannel, version: int, consumer: str, ms: int) -> int:
    """Make `consumer`'s pending request look untouched for `ms` (its owner unchanged); its idle time."""
    await ch.redis.xclaim(ch.names.eval_requests, EVALUATORS_GROUP, consumer, min_idle_time=0,
                          message_ids=[f"{version}-1"], idle=ms, justid=True)
    return await idle_ms(ch, version)


async def test_requests_are_idempotent_and_in_version_order(channel):
    assert await channel.request(3) is True
    assert await channel.request(3) is False  # a retried call, a resumed trainer
    assert await channel.request(2) is False  # older than one asked already
    assert await channel.request(5) is True
    assert await channel.outstanding() == [3, 5]
    with pytest.raises(ValueError, match="must be >= 0"):
        await channel.request(-1)


async def test_claim_takes_own_pending_first_then_new_then_none(channel):
    assert await claim(channel, "pod-0") is None  # nothing asked yet
    await channel.request(1)
    await channel.request(2)
    first = await claim(channel, "pod-0")
    assert first is not None and (first.version, first.entry_id) == (1, "1-1")
    again = await claim(channel, "pod-0")  # a restarted worker resumes its own unfinished request
    assert again == first
    other = await claim(channel, "pod-1")  # a live worker's request is not taken: the next one is
    assert other is not None and other.version == 2
    assert await claim(channel, "pod-2") is None
    assert await pending(channel) == {1: "pod-0", 2: "pod-1"}
    assert await channel.outstanding() == [1, 2]


async def test_a_dead_workers_idle_request_is_taken_over(channel):
    await channel.request(4)
    taken = await claim(channel, "pod-0")
    assert taken is not None
    idle = await left_idle(channel, 4, "pod-0", LEFT_IDLE_MS)  # pod-0 died: nobody touches the request
    assert idle >= LEFT_IDLE_MS
    assert await claim(channel, "pod-1", min_idle_ms=idle + NO_TAKEOVER_MS) is None  # not idle that long
    over = await claim(channel, "pod-1", min_idle_ms=TAKEOVER_MS)
    assert over == taken
    assert await pending(channel) == {4: "pod-1"}


async def test_touch_keeps_a_request_from_being_taken_over(channel):
    await channel.request(7)
    request = await claim(channel, "pod-0")
    assert request is not None
    assert await left_idle(channel, 7, "pod-0", LEFT_IDLE_MS) >= LEFT_IDLE_MS  # takeable now...
    await channel.touch("pod-0", request)  # ...but pod-0 is working on it
    assert await idle_ms(channel, 7) < TAKEOVER_MS
    assert await claim(channel, "pod-1", min_idle_ms=TAKEOVER_MS) is None
    assert await pending(channel) == {7: "pod-0"}


async def test_complete_publishes_once_and_retires_the_request(channel):
    await channel.request(0)
    await channel.request(1)
    request = await claim(channel, "pod-0")
    assert request is not None and request.version == 0
    entry = await channel.complete(request, record(0, 0.25))
    assert entry is not None
    [(got_id, got)] = await channel.results()
    assert got_id == entry and got.policy_version == 0 and got.reward_mean == 0.25
    assert await channel.outstanding() == [1]  # gone from the requests, and from the pending list
    assert await pending(channel) == {}
    # a second completion of the same request (a worker that had taken it over) publishes nothing
    assert await channel.complete(request, record(0, 0.75)) is None
    assert [r.reward_mean for _, r in await channel.results()] == [0.25]
    nxt = await claim(channel, "pod-0")
    assert nxt is not None and nxt.version == 1


async def test_results_page_after_an_entry_and_skip_undecodable_ones(channel):
    for v in range(5):
        await channel.request(v)
    for v in range(5):
        request = await claim(channel, "pod-0")
        assert request is not None and request.version == v
        assert await channel.complete(request, record(v)) is not None
        if v == 2:  # a whole page of undecodable entries must not hide the records after them
            await channel.redis.xadd(channel.names.eval_results, {b"data": b"not json"})
            await channel.redis.xadd(channel.names.eval_results, {b"other": b"field"})
    seen: list[int] = []
    after = "0-0"
    while page := await channel.results(after, count=2):
        assert len(page) <= 2
        seen += [r.policy_version for _, r in page]
        after = page[-1][0]
    assert seen == [0, 1, 2, 3, 4]
    assert await channel.results(after) == []
    assert await channel.outstanding() == []
