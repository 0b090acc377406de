"""Held-out evaluation requests (trainer -> rollout workers) and results (workers -> trainer).

The trainer asks for an evaluation of a policy version right after it published that version
(`request`); one rollout worker takes it (consumer group `evaluators`), answers the held-out
prompts on its engine between training groups, and hands back an EvalRecord (`complete`). The
trainer reads the results stream (`results`) into its report.

Why these shapes:
- the request's stream id *is* the version (`<version>-1`): Redis refuses an id at or below the
  stream's newest one, so asking twice for a version (a retried call, a resumed trainer) is a
  no-op with no extra key, and versions are asked for in order;
- at-least-once across crashes: a request stays pending until its worker completes it in one
  script (XACK, XDEL, result XADD). A worker that dies mid-evaluation leaves it pending; another
  worker takes it over once it has been idle `min_idle_ms` (XAUTOCLAIM), and a working evaluator
  keeps its request fresh (`touch`) so it is never taken from under it. Should two workers still
  finish one request (the first could not touch it through a Redis outage), only the first result
  is published: the script publishes only when its XACK retired the request;
- eval traffic never touches the trajectory stream or admission: nothing here is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from asyncrl.api.status_report import EvalRecord
from asyncrl.api.stream_names import StreamNames

EVALUATORS_GROUP = "evaluators"
DATA_FIELD = b"data"
RESULTS_KEPT = 10_000
"""The results stream keeps this many evaluations (the trainer reads them within seconds)."""


# KEYS: requests, results; ARGV: group, request id, record JSON, results kept -> result id | nil.
# The XACK decides: only the first completion of a request (its entry still pending) publishes.
_COMPLETE_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return false
end
redis.call('XDEL', KEYS[1], ARGV[2])
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[3])
"""


@dataclass(frozen=True)
class EvalRequest:
    """Evaluate policy `version`; `entry_id` is the request's stream id (`<version>-1`)."""

    version: int
    entry_id: str


def request_id(version: int) -> str:
    return f"{version}-1"


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _request(entry_id: Any) -> EvalRequest:
    eid = _s(entry_id)
    return EvalRequest(version=int(eid.split("-", 1)[0]), entry_id=eid)


class EvalChannel:
    """Both ends of one job's evaluation traffic."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.names = names
        self._complete = redis.register_script(_COMPLETE_LUA)

    # ------------------------------------------------------------------ trainer side

    async def request(self, version: int) -> bool:
        """Ask for an evaluation of `version`; False when it (or a newer version) was asked already."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        try:
            await self.redis.xadd(self.names.eval_requests, {b"version": str(version)}, id=request_id(version))
        except ResponseError as exc:
            if "equal or smaller" in str(exc):
                return False
            raise
        return True

    async def outstanding(self) -> list[int]:
        """Versions asked for and not completed yet (completed requests are deleted)."""
        entries: Any = await self.redis.xrange(self.names.eval_requests)
        return [_request(eid).version for eid, _ in entries]

    async def results(self, after: str = "0-0", count: int = 100) -> list[tuple[str, EvalRecord]]:
        """Up to `count` (entry id, record) of the results after `after`, oldest first. Undecodable
        entries are skipped, and read past: a page of them does not hide the records after it."""
        out: list[tuple[str, EvalRecord]] = []
        start = after
        while True:
            entries: Any = await self.redis.xrange(self.names.eval_results, min=f"({start}", count=count)
            for eid, fields in entries:
                try:
                    out.append((_s(eid), EvalRecord.model_validate_json(fields[DATA_FIELD])))
                except (KeyError, ValueError):
                    continue
            if out or len(entries) < count:
                return out
            start = _s(entries[-1][0])

    # ------------------------------------------------------------------ worker side

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.names.eval_requests, EVALUATORS_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim(self, consumer: str, *, block_ms: int, min_idle_ms: int) -> EvalRequest | None:
        """The next request for `consumer`: its own unfinished one (a restarted worker), one a dead
        worker left idle `min_idle_ms`, else a new one (blocking up to `block_ms`)."""
        key, group = self.names.eval_requests, EVALUATORS_GROUP
        own: Any = await self.redis.xreadgroup(group, consumer, {key: "0"}, count=1)
        for _, entries in own or []:
            if entries:
                return _request(entries[0][0])
        # (with justid, redis-py answers the claimed ids alone, not XAUTOCLAIM's [cursor, ids, deleted])
        claimed: Any = await self.redis.xautoclaim(key, group, consumer, min_idle_time=min_idle_ms,
                                                   start_id="0-0", count=1, justid=True)
        if claimed:
            return _request(claimed[0])
        fresh: Any = await self.redis.xreadgroup(group, consumer, {key: ">"}, count=1, block=block_ms)
        for _, entries in fresh or []:
            if entries:
                return _request(entries[0][0])
        return None

    async def touch(self, consumer: str, request: EvalRequest) -> None:
        """Reset the request's idle time: it is being worked on, no other worker may take it."""
        await self.redis.xclaim(self.names.eval_requests, EVALUATORS_GROUP, consumer, min_idle_time=0,
                                message_ids=[request.entry_id], justid=True)

    async def complete(self, request: EvalRequest, record: EvalRecord) -> str | None:
        """Publish the result and retire the request, atomically; None (nothing published) when the
        request was completed already (a worker that took it over finished first): one result per
        request. Returns the result's entry id."""
        reply = await self._complete(keys=[self.names.eval_requests, self.names.eval_results],
                                     args=[EVALUATORS_GROUP, request.entry_id, record.model_dump_json(),
                                           RESULTS_KEPT])
        return None if reply is None else _s(reply)
