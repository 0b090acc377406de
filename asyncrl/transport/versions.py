"""Weight-version channel (trainer -> rollout pods) and the registry of inference engines.

Why a stream and not PUB/SUB: a rollout pod that was restarting when the trainer published must
still find the latest version (`latest()` reads the newest entry), and a waiter cannot miss an
event between "check" and "block" (it blocks from the id it last saw, not from `$`).
The version stream is a broadcast log with no consumer group, so it is bounded by keeping only
the newest VERSION_HISTORY events (these are notifications, not training data).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from .names import StreamNames

VERSION_HISTORY = 1000
MAX_BLOCK_MS = 5000  # stays below the client's socket timeout


@dataclass
class VersionEvent:
    """New weights `version` are readable at `weights_path` (published at `time`, Unix seconds)."""

    version: int
    weights_path: str
    time: float


def _s(x: object) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _event(fields: dict) -> VersionEvent | None:
    try:
        return VersionEvent(version=int(fields[b"version"]), weights_path=_s(fields[b"weights_path"]),
                            time=float(fields[b"time"]))
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


class VersionChannel:
    """Publish and follow weight versions of one job."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.names = names

    async def publish(self, event: VersionEvent) -> str:
        """Append the event (keeps the last VERSION_HISTORY events). Returns the entry id."""
        entry_id = await self.redis.xadd(
            self.names.versions,
            {"version": str(int(event.version)), "weights_path": event.weights_path,
             "time": repr(float(event.time))},
            maxlen=VERSION_HISTORY, approximate=True)
        return _s(entry_id)

    async def latest(self) -> VersionEvent | None:
        """The newest event, or None when no version was published yet."""
        _, event = await self._latest_entry()
        return event

    async def wait_newer(self, than: int, timeout: float) -> VersionEvent | None:
        """The newest event with version > `than`, waiting up to `timeout` s; None on timeout."""
        deadline = time.monotonic() + timeout
        last_id, event = await self._latest_entry()
        while True:
            if event is not None and event.version > than:
                return event
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            reply = await self.redis.xread({self.names.versions: last_id},
                                           block=min(max(remaining_ms, 1), MAX_BLOCK_MS))
            for _, entries in reply or []:
                for raw_id, fields in entries:
                    last_id = _s(raw_id)
                    candidate = _event(fields)
                    if candidate is not None and (event is None or candidate.version >= event.version):
                        event = candidate

    async def _latest_entry(self) -> tuple[str, VersionEvent | None]:
        entries = await self.redis.xrevrange(self.names.versions, count=1)
        if not entries:
            return "0-0", None
        raw_id, fields = entries[0]
        return _s(raw_id), _event(fields)


@dataclass
class EngineInfo:
    """An inference engine as the trainer needs to know it (to pause/update/resume it)."""

    engine_id: str
    url: str
    weight_version: int | None
    ready: bool
    heartbeat: float


class EngineRegistry:
    """Hash engine_id -> JSON; rollout pods re-register (heartbeat) periodically."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.names = names

    async def register(self, info: EngineInfo) -> None:
        """Insert or refresh an engine (call every few seconds as a heartbeat)."""
        await self.redis.hset(self.names.engines, info.engine_id, json.dumps(asdict(info)))

    async def list(self, max_age_s: float = 30) -> list[EngineInfo]:
        """Engines whose heartbeat is at most `max_age_s` old, sorted by id (corrupt entries skipped)."""
        now = time.time()
        out = []
        for raw in (await self.redis.hgetall(self.names.engines)).values():
            try:
                info = EngineInfo(**json.loads(raw))
            except (ValueError, TypeError):
                continue
            if now - info.heartbeat <= max_age_s:
                out.append(info)
        return sorted(out, key=lambda e: e.engine_id)

    async def remove(self, engine_id: str) -> None:
        """Forget an engine (its pod is shutting down)."""
        await self.redis.hdel(self.names.engines, engine_id)
