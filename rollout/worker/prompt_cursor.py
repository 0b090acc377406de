"""Which prompt a worker takes next, resumable across restarts, with interrupted prompts first.

Two ways to walk the dataset (spec.rollout.replicas, WorkerConfig.rollout_replicas):
  fixed shards   replica i of n takes positions i, i + n, ...; its low-water mark (every position
                 below it finished) is saved in Redis after each group, so a restarted worker
                 resumes where it left off (a group in flight at a crash is generated again).
  shared cursor  (replicas 0: a Deployment's pods have no stable index) one job-wide counter, one
                 atomic INCR per prompt: every position goes to exactly one worker, and the counter
                 survives worker restarts.
A group interrupted by its engine going away is the engine's fault, not the prompt's: its position
is queued again (`requeue`) and taken before any new one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.api.stream_names import StreamNames
from asyncrl.rollout.data.datasets import ShardCursor

log = logging.getLogger("asyncrl.rollout.worker")


def cursor_key(names: StreamNames, index: int, replicas: int) -> str:
    """Redis key of a shard's resumable cursor (same hash tag as the job's other keys)."""
    shard = "shared" if replicas == 0 else f"{index}-of-{replicas}"
    return names.rollout_cursor(shard)


class PromptCursor:
    def __init__(self, redis: Any, names: StreamNames, index: int, replicas: int) -> None:
        self.redis = redis
        self.index, self.replicas = index, replicas
        self.shared = replicas == 0
        self.shard = ShardCursor(index, max(1, replicas))
        self.key = cursor_key(names, index, replicas)
        self.requeued: list[tuple[int, int]] = []
        """(local index, dataset position) of interrupted groups, taken again before new prompts."""
        self._saves: set[asyncio.Future] = set()
        self._done_locals: set[int] = set()
        self._low_water = 0
        self._saved_low_water = -1  # (the last value written: -1, none yet)
        self._lock = asyncio.Lock()

    def requeue(self, local: int, position: int) -> None:
        self.requeued.append((local, position))

    async def take(self) -> tuple[int, int]:
        """(local index, dataset position) of the next prompt: an interrupted group's first."""
        if self.requeued:
            return self.requeued.pop(0)
        if self.shared:
            position = int(await self.redis.incr(self.key)) - 1
            return position, position
        return self.shard.take()

    def mark_done(self, local: int) -> None:
        """The group at `local` finished (published or dropped): advance and save the low-water mark."""
        if self.shared:
            return
        self._done_locals.add(local)
        while self._low_water in self._done_locals:
            self._done_locals.discard(self._low_water)
            self._low_water += 1
        task = asyncio.ensure_future(self.save())
        self._saves.add(task)  # keep a reference until it is done (the loop holds only weak ones)
        task.add_done_callback(self._saves.discard)

    async def saved(self) -> None:
        """Wait for the saves in flight."""
        await asyncio.gather(*list(self._saves))

    async def save(self) -> None:
        """Write the low-water mark. One write at a time, each of the value current when it starts:
        saves started by completions that finish close together (and the final one at shutdown)
        would otherwise race on separate connections and an older value could land last."""
        if self.shared:
            return
        async with self._lock:
            value = self._low_water
            if value == self._saved_low_water:
                return
            try:
                await self.redis.set(self.key, value)
                self._saved_low_water = value
            except Exception as exc:
                log.warning("could not save the dataset cursor: %s", exc)

    async def restore(self) -> None:
        if self.shared:
            return
        raw = await self.redis.get(self.key)
        if raw is not None:
            self._low_water = self._saved_low_water = int(raw)
            self.shard.next = self._low_water
            log.info("resuming shard %d/%d at prompt %d", self.index, self.replicas, self._low_water)
