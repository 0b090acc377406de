"""Job-wide recovery counters: how often the job's trainer started, its engines restarted and were
re-synced; and the trainer timeline started last. Kept in Redis (one hash per job) rather than in a
checkpoint, so a trainer killed before its next checkpoint still counts; the trainer writes them,
the status report and the operator read."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from asyncrl.api.stream_names import StreamNames

FIELDS = ("trainer_starts", "engine_restarts", "engine_resyncs")
TIMELINE_FIELD = "timeline"
"""Beside the counters: the trainer timeline started last (trainer/state/timelines.py)."""


@dataclass
class RecoveryCounts:
    trainer_starts: int = 0
    """Trainer lives that trained (the first start included; a restart after the end does not count)."""
    engine_restarts: int = 0
    """Rollout engines seen coming back as a new incarnation (a restarted server)."""
    engine_resyncs: int = 0
    """Engines the trainer's catch-up loaded with the current weights (joined late, restarted, or lagging)."""


class RecoveryCounters:
    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.key = names.recovery

    async def add(self, field: str, n: int = 1) -> int:
        """Count `n` more of `field` (one of FIELDS); the new total."""
        if field not in FIELDS:
            raise ValueError(f"unknown recovery counter {field!r}; allowed: {', '.join(FIELDS)}")
        return int(await self.redis.hincrby(self.key, field, n))

    async def last_timeline(self) -> int | None:
        """The trainer timeline started last (asyncrl.api.weight_labels; None: none recorded)."""
        raw = await self.redis.hget(self.key, TIMELINE_FIELD)
        return None if raw is None else int(raw)

    async def set_timeline(self, timeline: int) -> None:
        await self.redis.hset(self.key, TIMELINE_FIELD, timeline)

    async def read(self) -> RecoveryCounts:
        raw = await self.redis.hmget(self.key, list(FIELDS))
        return RecoveryCounts(*(int(v or 0) for v in raw))
