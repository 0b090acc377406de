"""Weight-version channel (trainer -> rollout pods) and the registry of inference engines.

Why a stream and not PUB/SUB: a rollout pod that was restarting when the trainer published must
still find the latest version (`latest()` reads the newest entry), and a waiter cannot miss an
event between "check" and "block" (it blocks from the id it last saw, not from `$`).
The version stream is a broadcast log with no consumer group, so it is bounded by keeping only
the newest VERSION_HISTORY events (these are notifications, not training data).

The registry has two writers with separate keys: rollout workers register their engine (and what
they observe of it) every few seconds; the trainer, the only one that updates engine weights
(trainer/weights/engine_update.py), records per engine what it loaded (`EngineWeights`). That record is the
weight label of engines whose server reports none.

Engines restart. Each registration carries the engine server's incarnation (an id that changes when
the server restarts, see rollout/generation/engine_view.py), and the trainer's record names the incarnation it
loaded into: a record of an earlier incarnation says nothing about what the server serves now (a
restarted server serves the weights it was launched with, whatever the trainer loaded before), so
it is ignored and the version stays what the worker observed, or unknown (None). An engine whose
updates keep failing is fenced in the record (`EngineWeights.fenced`): left out of pushes,
retried by catch-up after a backoff, unfenced by the first update that succeeds.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis.asyncio as aioredis

from asyncrl.api.stream_names import StreamNames
from asyncrl.api.weight_labels import WeightLabel

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


def _event(fields: Any) -> VersionEvent | None:
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
            reply: Any = await self.redis.xread({self.names.versions: last_id},
                                                block=min(max(remaining_ms, 1), MAX_BLOCK_MS))
            for _, entries in reply or []:
                for raw_id, fields in entries:
                    last_id = _s(raw_id)
                    candidate = _event(fields)
                    if candidate is not None and (event is None or candidate.version >= event.version):
                        event = candidate

    async def _latest_entry(self) -> tuple[str, VersionEvent | None]:
        entries: Any = await self.redis.xrevrange(self.names.versions, count=1)
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
    """Registered: what the worker observed. From `EngineRegistry.list()`: the newer of that and
    the trainer's record (`EngineWeights`), so it is right just after an update too."""
    ready: bool
    heartbeat: float
    """When the worker observed the engine (Unix seconds)."""
    incarnation: str = ""
    """The engine server's current life: the server's own id when it reports one (our hf server),
    else minted by its worker when it sees the server restart (rollout/generation/engine_view.py)."""
    label: str | None = None
    """The weight label exactly as the server last reported it ("default", "7"; None: the server
    reports none (vLLM), or it could not be read)."""
    fenced: str = ""
    """From `EngineRegistry.list()`: why the trainer fenced this engine ("" = not fenced)."""
    weight_timeline: int = 0
    """The trainer timeline of `weight_version` (asyncrl.api.weight_labels)."""

    def weights(self) -> WeightLabel | None:
        """The label of the weights it serves (None: unknown)."""
        return None if self.weight_version is None else WeightLabel(self.weight_version, self.weight_timeline)


@dataclass
class EngineWeights:
    """The trainer's record of what it loaded into one engine (written only by the trainer)."""

    version: int | None = None
    """The version the trainer last loaded (None: never; the engine serves its initial weights, 0)."""
    timeline: int = 0
    """The trainer timeline of `version` (asyncrl.api.weight_labels)."""
    updating: int | None = None
    """The version being loaded while the trainer holds the engine paused, else None."""
    updating_timeline: int = 0
    """The trainer timeline of `updating`."""
    until: float = 0.0
    """Unix time after which an `updating` marker is void (a trainer that died mid-update)."""
    epoch: int = 0
    """Counts the trainer's updates of this engine (begun ones, failed ones included)."""
    time: float = 0.0
    """When the record was last written (Unix seconds)."""
    incarnation: str = ""
    """The engine incarnation (EngineInfo.incarnation) the trainer last loaded `version` into."""
    fenced: str = ""
    """Why the last update failed ("" = the engine is not fenced): a fenced engine is left out of
    pushes and retried by catch-up from `retry_at` on (trainer/weights/engine_update.py)."""
    failures: int = 0
    """Updates of this engine that failed in a row (sets the catch-up backoff)."""
    retry_at: float = 0.0
    """Unix time from which catch-up tries a fenced engine again."""

    def in_progress(self, now: float | None = None) -> bool:
        """True while the trainer is pausing/updating/resuming this engine."""
        return self.updating is not None and (time.time() if now is None else now) < self.until

    @property
    def label(self) -> WeightLabel:
        """The weights the engine serves as far as the trainer knows (version 0: its initial ones)."""
        return WeightLabel(self.version, self.timeline) if self.version is not None else WeightLabel(0)

    def label_for(self, incarnation: str) -> WeightLabel | None:
        """The weights engine life `incarnation` serves as far as the trainer knows; None: unknown
        (the trainer loaded weights into an earlier life of the server, or into another one)."""
        if self.version is None:
            return WeightLabel(0)  # never loaded: the server serves the weights it was launched with
        return self.label if self.incarnation == incarnation else None


def _weights(raw: Any) -> EngineWeights | None:
    try:
        return EngineWeights(**json.loads(raw))
    except (ValueError, TypeError):
        return None


# KEYS: engines, engine weights. ARGV: older_than_s -> entries removed (heartbeats and records).
_PRUNE_LUA = """
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) + tonumber(t[2]) / 1e6 - tonumber(ARGV[1])
local removed = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local ok, info = pcall(cjson.decode, entries[i + 1])
  if not ok or type(info) ~= 'table' or tonumber(info['heartbeat'] or 0) < cutoff then
    removed = removed + redis.call('HDEL', KEYS[1], entries[i])
  end
end
local records = redis.call('HGETALL', KEYS[2])
for i = 1, #records, 2 do
  if redis.call('HEXISTS', KEYS[1], records[i]) == 0 then
    local ok, rec = pcall(cjson.decode, records[i + 1])
    if not ok or type(rec) ~= 'table' or tonumber(rec['time'] or 0) < cutoff then
      removed = removed + redis.call('HDEL', KEYS[2], records[i])
    end
  end
end
return removed
"""


class EngineRegistry:
    """Hash engine_id -> JSON EngineInfo (workers' heartbeats), and engine_id -> JSON EngineWeights
    (the trainer's record) under a sibling key with the same hash tag."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.names = names
        self.weights_key = names.engine_weights
        self._prune = redis.register_script(_PRUNE_LUA)

    async def register(self, info: EngineInfo) -> None:
        """Insert or refresh an engine (call every few seconds as a heartbeat)."""
        await self.redis.hset(self.names.engines, info.engine_id, json.dumps(asdict(info)))

    async def list(self, max_age_s: float = 30) -> list[EngineInfo]:
        """Engines whose heartbeat is at most `max_age_s` old, sorted by id (corrupt entries skipped).

        `weight_version` is the newest knowledge: the trainer's record when it was written after
        the worker's observation (a fresh update) into the same incarnation, else what the worker
        observed (e.g. an engine that restarted on its initial weights since; None: unknown).
        `fenced` comes from the trainer's record."""
        now = time.time()
        records = await self.all_weights()
        out = []
        raw_infos: Any = await self.redis.hgetall(self.names.engines)
        for raw in raw_infos.values():
            try:
                info = EngineInfo(**json.loads(raw))
            except (ValueError, TypeError):
                continue
            if now - info.heartbeat > max_age_s:
                continue
            rec = records.get(info.engine_id)
            if (rec is not None and rec.version is not None and rec.incarnation == info.incarnation
                    and (info.weight_version is None or rec.time >= info.heartbeat)):
                info.weight_version, info.weight_timeline = rec.version, rec.timeline
            if rec is not None:
                info.fenced = rec.fenced
            out.append(info)
        return sorted(out, key=lambda e: e.engine_id)

    async def prune(self, older_than_s: float) -> int:
        """Forget engines whose last heartbeat is older than `older_than_s` (their pods are gone:
        replaced under another name, or scaled away), corrupt entries, and the trainer's records of
        engines that have no entry and were not updated for as long; how many entries went. One
        script, so a worker that heartbeats meanwhile is never removed."""
        return int(await self._prune(keys=[self.names.engines, self.weights_key], args=[older_than_s]))

    async def remove(self, engine_id: str) -> None:
        """Forget an engine (its pod is shutting down). The trainer's record stays: a restarted
        worker finds its engine's weights still described."""
        await self.redis.hdel(self.names.engines, engine_id)

    # -- the trainer's record (trainer/weights/engine_update.py writes, rollout workers read) --------------

    async def weights(self, engine_id: str) -> EngineWeights | None:
        """The trainer's record for one engine (None: the trainer never updated it)."""
        return _weights(await self.redis.hget(self.weights_key, engine_id))

    async def all_weights(self) -> dict[str, EngineWeights]:
        raw: Any = await self.redis.hgetall(self.weights_key)
        out = {}
        for key, value in raw.items():
            rec = _weights(value)
            if rec is not None:
                out[_s(key)] = rec
        return out

    async def begin_update(self, engine_id: str, version: WeightLabel | int, timeout_s: float) -> EngineWeights:
        """Mark `engine_id` as being updated to `version` (before pausing it)."""
        rec = await self.weights(engine_id) or EngineWeights()
        now = time.time()
        label = WeightLabel.of(version)
        rec = replace(rec, updating=label.version, updating_timeline=label.timeline, until=now + timeout_s,
                      epoch=rec.epoch + 1, time=now)
        await self._write(engine_id, rec)
        return rec

    async def end_update(self, engine_id: str, *, loaded: bool, incarnation: str | None = None) -> EngineWeights:
        """Clear the marker (before resuming); `loaded`: the engine (life `incarnation`) now serves
        the marked version and is unfenced, else it keeps the version recorded before (a failed
        update changes nothing we can know)."""
        rec = await self.weights(engine_id) or EngineWeights()
        if loaded and rec.updating is not None:
            rec = replace(rec, version=rec.updating, timeline=rec.updating_timeline, incarnation=incarnation or "",
                          fenced="", failures=0, retry_at=0.0)
        rec = replace(rec, updating=None, until=0.0, time=time.time())
        await self._write(engine_id, rec)
        return rec

    async def fence(self, engine_id: str, reason: str, *, backoff_s: float, backoff_max_s: float) -> EngineWeights:
        """Record a failed update: the engine is fenced (left out of pushes) and catch-up tries it
        again after a backoff that doubles with each failure in a row, up to `backoff_max_s`."""
        rec = await self.weights(engine_id) or EngineWeights()
        failures = rec.failures + 1
        now = time.time()
        rec = replace(rec, fenced=reason[:500] or "update failed", failures=failures,
                      retry_at=now + min(backoff_max_s, backoff_s * 2 ** (failures - 1)), time=now)
        await self._write(engine_id, rec)
        return rec

    async def _write(self, engine_id: str, rec: EngineWeights) -> None:
        await self.redis.hset(self.weights_key, engine_id, json.dumps(asdict(rec)))
