"""Trajectory stream: producers XADD whole groups; the trainer reads, trains, then acks.

Guarantees (with one consumer group per stream, `names.consumer_group`):
- nothing unacked is lost: entries stay in the group's pending list until `ack`, a restarted
  consumer with the same name re-reads its own pending entries first, and `reclaim` takes over
  entries a dead consumer left idle (XAUTOCLAIM);
- nothing is stranded in a running consumer: `recover_pending` re-reads its own pending list and
  delivers entries it holds but never handed out. A lost XREADGROUP reply does that (redis-py
  retried the command; Redis had already delivered the entries, the client never saw them), and
  the entries would otherwise wait for the next restart. The trainer's inbox calls it, and
  `reclaim`, periodically;
- nothing is trained twice: `ack` adds the group ids to the job's `trained` ids in the same
  atomic script that XACKs and deletes the entries, and `read`/`reclaim`/`recover_pending` skip
  (and ack) any copy whose group id is already trained, already in flight in this consumer, or
  repeated within the same read (a producer that retried a publish after a lost reply leaves two
  copies). A trainer resumed from a checkpoint that was written but whose ack never ran hands the
  checkpoint's window to `ack_committed` (same script) before reading: trainer/state/checkpoint.py says
  why that closes the commit window;
- memory stays bounded: acked entries are XDEL'd and the stream is XTRIM'd by MINID up to the
  oldest pending entry; MAXLEN is never used (it would drop delivered-but-unacked entries). The
  trained ids (a sorted set scored by the time in their entry's id) are pruned by the same ack
  script: an id whose entry is older than the stream's oldest entry by TRAINED_RETENTION_MS
  can have no copy left to skip. A copy is a producer's retried publish, made within its outage
  window (minutes) of the original, so it is never that much newer than the original; an id
  marked without an entry (`ack_committed`) is scored by the time of the mark, which is later
  than its entry. The dead-letter stream keeps the newest DEAD_LETTER_MAXLEN entries;
- a payload that does not decode, or decodes to a group that cannot be trained (`content.check_group`:
  NaN logprobs, lengths that disagree, ...), goes to the dead-letter stream with the reason and the
  raw bytes, and is acked, instead of crashing the trainer. This holds for this consumer's own
  pending entries re-read after a restart too, so a poison group cannot crash-loop the trainer.

Limitation: with two live consumers, an entry reclaimed from a consumer that is slow rather than
dead is held by both until one acks. Pick `min_idle_ms` well above the longest training step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from asyncrl.api.stream_names import StreamNames

from .content import GroupLimits, check_group
from .wire import TrajectoryGroup, WireFormatError, decode_group, encode_group

log = logging.getLogger("asyncrl.transport.streams")

DATA_FIELD = b"data"
GID_FIELD = b"gid"

# Shared Lua helper: compare two stream ids "ms-seq" numerically (ms fits a double exactly).
_ID_LT = """
local function split(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_lt(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  if am ~= bm then return am < bm end
  return as < bs
end
"""

TRAINED_RETENTION_MS = 3_600_000
"""How much older than the stream's oldest entry a trained id's entry must be before it is pruned
(the top of this module says why an hour is ample)."""

DEAD_LETTER_MAXLEN = 10_000
UNTRAINABLE, REWARD_FAILED, EPISODE_FAILED = "untrainable", "reward failed", "episode failed"
"""A dead letter's kind, as its reason's prefix (`<kind>: ...`); a reason with neither did not decode."""
"""Dead letters kept (the newest; approximate trimming): for inspection (`asyncrl dead-letters`)."""

# KEYS: stream, trained. ARGV: group, retention_ms, then (entry_id, group_id) pairs; an empty
# entry_id marks the group trained without an entry (`ack_committed`: its entry is not in this
# consumer's list). Marks the group ids trained (scored by the entry's time, else now), acks and
# deletes the entries, trims everything below min(oldest still-pending id, newest acked id) (such
# entries were delivered, ids are delivered in order, and are not pending, so they are acked),
# then prunes trained ids older than the stream's oldest entry by retention_ms. Returns the group
# ids that were already trained.
_ACK_LUA = _ID_LT + """
local stream, trained, group, retention = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local already = {}
local newest = nil
for i = 3, #ARGV, 2 do
  local id, gid = ARGV[i], ARGV[i + 1]
  local score = now
  if id ~= '' then score = split(id) end
  if redis.call('ZADD', trained, 'NX', score, gid) == 0 then table.insert(already, gid) end
  if id ~= '' then
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    if newest == nil or id_lt(newest, id) then newest = id end
  end
end
if newest ~= nil then
  local summary = redis.call('XPENDING', stream, group)
  local minid = newest
  if tonumber(summary[1]) > 0 and id_lt(summary[2], minid) then minid = summary[2] end
  redis.call('XTRIM', stream, 'MINID', minid)
end
local oldest = now
local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)
if first[1] then oldest = math.min(split(first[1][1]), now) end
redis.call('ZREMRANGEBYSCORE', trained, '-inf', '(' .. (oldest - retention))
return already
"""

# KEYS: stream. ARGV: group, entry ids. Ack and delete entries we skip (duplicates, deleted).
_DISCARD_LUA = """
for i = 2, #ARGV do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
end
return #ARGV - 1
"""

# KEYS: stream. ARGV: group, consumer, start (exclusive), count. Up to `count` entries of the
# consumer's pending list after `start`, as a flat list id1, gid1, id2, gid2, ... (gid '' when the
# entry was deleted or has no gid field): ids and group ids only, never the payloads.
_OWN_PENDING_LUA = """
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], '(' .. ARGV[3], '+', tonumber(ARGV[4]), ARGV[2])
local out = {}
for _, row in ipairs(rows) do
  local gid = ''
  local entry = redis.call('XRANGE', KEYS[1], row[1], row[1])
  if entry[1] then
    local fields = entry[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'gid' then gid = fields[i + 1] end
    end
  end
  table.insert(out, row[1])
  table.insert(out, gid)
end
return out
"""

# KEYS: stream, dead_letter. ARGV: group, entry_id, error, payload, consumer, time, maxlen.
_DEAD_LETTER_LUA = """
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'source_id', ARGV[2], 'error', ARGV[3],
                      'payload', ARGV[4], 'consumer', ARGV[5], 'time', ARGV[6])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


@dataclass
class Delivery:
    """One decoded group handed to the trainer; pass it back to `ack` once the step is committed."""

    entry_id: str
    group: TrajectoryGroup


@dataclass
class ConsumerStats:
    """Counters of one consumer object (for metrics; tests check behaviour from Redis, not these)."""

    delivered: int = 0
    reclaimed: int = 0
    duplicates_skipped: int = 0
    dead_lettered: int = 0
    """Entries moved to the dead-letter stream, for any reason (the two below, or no `data`)."""
    undecodable: int = 0
    """Of `dead_lettered`: payloads that are not the wire format."""
    untrainable: int = 0
    """Of `dead_lettered`: groups that decoded but failed `check_group` (e.g. a NaN logprob)."""
    acked: int = 0
    acked_already_trained: int = 0
    recovered: int = 0
    """Entries found in this consumer's own pending list that it had never handed out (lost replies)."""
    acked_committed: int = 0
    """Pending entries acknowledged on resume because the restored checkpoint had trained them."""


class TrajectoryProducer:
    """Publishes whole groups, one XADD each (atomic: a reader sees all samples or none)."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames) -> None:
        self.redis = redis
        self.names = names

    async def publish(self, group: TrajectoryGroup) -> str:
        """Encode and XADD `group`; stamps `published_at` when it is 0. Returns the entry id.

        Retrying after a connection error may add a second copy; consumers train it once.
        """
        if not group.published_at:
            group = dataclasses.replace(group, published_at=time.time())
        payload = encode_group(group)
        entry_id = await self.redis.xadd(self.names.trajectories,
                                         {GID_FIELD: group.group_id.encode(), DATA_FIELD: payload})
        return _s(entry_id)

    async def dead_letter_refused(self, group: TrajectoryGroup, kind: str, reason: str, producer: str) -> str:
        """Put a group its producer refuses to publish (its reward failed: REWARD_FAILED; its episodes
        did: EPISODE_FAILED) straight into the dead-letter stream, as the trainer files the groups it
        refuses (no `source_id`: it never was a trajectory entry). Returns the dead letter's id."""
        entry_id = await self.redis.xadd(
            self.names.dead_letter, {"source_id": "", "error": f"{kind}: {reason}",
                                     "payload": encode_group(group),
                                     "consumer": producer, "time": repr(time.time())},
            maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        return _s(entry_id)


class TrajectoryConsumer:
    """A trainer's reader with a stable `consumer` name (the pod name) in the job's group.

    `limits` is what the trainer knows about trainable groups (vocabulary, group size, longest
    response); every decoded group is checked against it before it is delivered.
    """

    def __init__(self, redis: aioredis.Redis, names: StreamNames, consumer: str, *,
                 limits: GroupLimits | None = None) -> None:
        if not consumer:
            raise ValueError("consumer name must be non-empty and stable across restarts")
        self.redis = redis
        self.names = names
        self.consumer = consumer
        self.limits = limits or GroupLimits()
        self.stats = ConsumerStats()
        self._group_ready = False
        self._pending_cursor: str | None = "0"  # own pending entries first, then new ones
        self._inflight: dict[str, str] = {}  # group id -> entry id, delivered and not yet acked
        self._ack = redis.register_script(_ACK_LUA)
        self._discard = redis.register_script(_DISCARD_LUA)
        self._dead = redis.register_script(_DEAD_LETTER_LUA)
        self._own_pending = redis.register_script(_OWN_PENDING_LUA)

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if missing; idempotent.

        Starts at id 0 so groups published before the first trainer started are consumed.
        """
        try:
            await self.redis.xgroup_create(self.names.trajectories, self.names.consumer_group,
                                           id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        """Up to `count` groups: this consumer's pending entries first (after a restart), then new.

        Blocks up to `block_ms` only when reading new entries. May return fewer than `count`
        (or none) when entries were dead-lettered or skipped as duplicates.
        """
        if count <= 0:
            raise ValueError("count must be positive")
        if not self._group_ready:
            await self.ensure_group()
        if self._pending_cursor is not None:
            entries = await self._xreadgroup(self._pending_cursor, count, None)
            if entries:
                self._pending_cursor = _s(entries[-1][0])
                return await self._settle(entries)
            self._pending_cursor = None
        entries = await self._xreadgroup(">", count, block_ms if block_ms > 0 else None)
        return await self._settle(entries)

    async def reclaim(self, min_idle_ms: int, count: int = 100) -> list[Delivery]:
        """Take over entries idle for `min_idle_ms` in any consumer's pending list (XAUTOCLAIM)."""
        if not self._group_ready:
            await self.ensure_group()
        claimed: list = []
        start = "0-0"
        while len(claimed) < count:
            reply = await self.redis.xautoclaim(self.names.trajectories, self.names.consumer_group,
                                                self.consumer, min_idle_ms, start,
                                                count=count - len(claimed))
            claimed.extend(reply[1])
            start = _s(reply[0])
            if start == "0-0":
                break
        deliveries = await self._settle(claimed)
        self.stats.reclaimed += len(deliveries)
        return deliveries

    async def ack(self, deliveries: Iterable[Delivery]) -> list[str]:
        """Commit: mark the groups trained, XACK and delete their entries (one atomic script).

        Call only after the step that used them is committed. Returns group ids that another
        consumer had already marked trained (normally empty; non-empty means a double train).
        """
        pairs: list[str] = []
        for d in deliveries:
            pairs += [d.entry_id, d.group.group_id]
        if not pairs:
            return []
        already = await self._mark_trained(pairs)
        for i in range(0, len(pairs), 2):
            if self._inflight.get(pairs[i + 1]) == pairs[i]:
                del self._inflight[pairs[i + 1]]
        self.stats.acked += len(pairs) // 2
        self.stats.acked_already_trained += len(already)
        return [_s(g) for g in already]

    async def ack_committed(self, group_ids: Iterable[str]) -> int:
        """On resume: the restored checkpoint trained `group_ids`; acknowledge them, never train them.

        One call of the ack script marks every id trained and acks and deletes this consumer's
        pending entries that carry one (copies included); an id whose entry is not in this list
        (already acked, or pending under another consumer name) is marked trained only, so whoever
        reads or reclaims it later skips it. Call before the first `read`. Returns how many pending
        entries it acknowledged (0 unless the previous life was killed between its checkpoint and
        its ack; trainer/state/checkpoint.py).
        """
        wanted = set(group_ids)
        if not wanted:
            return 0
        if not self._group_ready:
            await self.ensure_group()
        pairs: list[str] = []
        found: set[str] = set()
        for entry_id, gid in await self._own_pending_ids():
            if gid in wanted:
                pairs += [entry_id, gid]
                found.add(gid)
        entries = len(pairs) // 2
        for gid in sorted(wanted - found):
            pairs += ["", gid]
        await self._mark_trained(pairs)
        for i in range(0, len(pairs), 2):
            if pairs[i] and self._inflight.get(pairs[i + 1]) == pairs[i]:
                del self._inflight[pairs[i + 1]]
        self.stats.acked_committed += entries
        return entries

    async def _mark_trained(self, pairs: list[str]) -> list[Any]:
        """The ack script on (entry id or "", group id) pairs; the group ids that were already trained."""
        return list(await self._ack(keys=[self.names.trajectories, self.names.trained],
                                    args=[self.names.consumer_group, TRAINED_RETENTION_MS, *pairs]))

    async def recover_pending(self) -> list[Delivery]:
        """Deliver the entries of this consumer's own pending list that it never handed out.

        Redis puts an entry in the pending list when it answers XREADGROUP; if that reply is lost
        (redis-py retries the command on a connection error, and the retry reads *new* entries),
        the entry is held by this consumer and seen by nobody until a restart. The list is read
        as ids and group ids only (a script: no payloads); entries in flight here are skipped, the
        rest are claimed by this consumer (XCLAIM, which returns their fields) and go through the
        usual checks (a copy of a trained or in-flight group is acked, not delivered).
        """
        if not self._group_ready:
            await self.ensure_group()
        held = set(self._inflight.values())
        lost: list[Any] = [entry_id for entry_id, _ in await self._own_pending_ids() if entry_id not in held]
        if not lost:
            return []
        claimed: Any = await self.redis.xclaim(self.names.trajectories, self.names.consumer_group,
                                               self.consumer, 0, lost)
        deliveries = await self._settle(list(claimed or []))
        self.stats.recovered += len(deliveries)
        if deliveries:
            log.warning("recovered %d entr%s pending for %s but never handed out (a lost read reply)",
                        len(deliveries), "y" if len(deliveries) == 1 else "ies", self.consumer)
        return deliveries

    async def pending_count(self) -> int:
        """Entries delivered to any consumer of the group and not yet acked."""
        summary = await self.redis.xpending(self.names.trajectories, self.names.consumer_group)
        return int(summary["pending"])

    # ------------------------------------------------------------------------------- internals

    async def _own_pending_ids(self, page: int = 1000) -> list[tuple[str, str]]:
        """(entry id, group id) of every entry in this consumer's pending list, oldest first."""
        out: list[tuple[str, str]] = []
        start = "0-0"
        while True:
            flat = await self._own_pending(keys=[self.names.trajectories],
                                           args=[self.names.consumer_group, self.consumer, start, page])
            rows = [(_s(flat[i]), _s(flat[i + 1])) for i in range(0, len(flat), 2)]
            out += rows
            if len(rows) < page:
                return out
            start = rows[-1][0]

    async def _xreadgroup(self, entry_id: str, count: int, block: int | None) -> list:
        reply: Any = None  # redis-py's reply type depends on RESP2/RESP3
        for attempt in (0, 1):
            try:
                reply = await self.redis.xreadgroup(self.names.consumer_group, self.consumer,
                                                    {self.names.trajectories: entry_id},
                                                    count=count, block=block)
                break
            except ResponseError as exc:
                # The group vanished (Redis lost its data or someone deleted the stream).
                if "NOGROUP" not in str(exc) or attempt:
                    raise
                await self.ensure_group()
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3
            return next(iter(reply.values()))[0] if reply else []
        return reply[0][1]

    async def _settle(self, entries: list) -> list[Delivery]:
        """Decode and check entries; dead-letter bad ones, skip duplicates; return the rest."""
        decoded: list[tuple[str, TrajectoryGroup]] = []
        discard: list[str] = []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            if not fields:  # deleted while pending (e.g. acked by a consumer we took it from)
                discard.append(entry_id)
                continue
            payload = fields.get(DATA_FIELD)
            if payload is None:
                await self._dead_letter(entry_id, "entry has no 'data' field; fields: "
                                        + ", ".join(sorted(_s(k) for k in fields)), b"")
                continue
            try:
                group = decode_group(payload)
            except WireFormatError as exc:
                self.stats.undecodable += 1
                await self._dead_letter(entry_id, str(exc), payload)
                continue
            problem = check_group(group, self.limits)
            if problem is not None:
                self.stats.untrainable += 1
                await self._dead_letter(entry_id, f"{UNTRAINABLE}: {problem}", payload)
                continue
            decoded.append((entry_id, group))
        deliveries: list[Delivery] = []
        if decoded:
            gids = [g.group_id for _, g in decoded]
            trained = [score is not None for score in await self.redis.zmscore(self.names.trained, gids)]
            seen: set[str] = set()
            for (entry_id, group), is_trained in zip(decoded, trained):
                gid = group.group_id
                holding = self._inflight.get(gid)
                if holding == entry_id:
                    # our own in-flight entry handed to us again (e.g. reclaimed from ourselves):
                    # the trainer already has it; keep it pending, do not deliver twice
                    self.stats.duplicates_skipped += 1
                    continue
                if is_trained or holding is not None or gid in seen:
                    discard.append(entry_id)
                    self.stats.duplicates_skipped += 1
                    continue
                seen.add(gid)
                self._inflight[gid] = entry_id
                deliveries.append(Delivery(entry_id, group))
        if discard:
            await self._discard(keys=[self.names.trajectories],
                                args=[self.names.consumer_group, *discard])
        self.stats.delivered += len(deliveries)
        return deliveries

    async def _dead_letter(self, entry_id: str, error: str, payload: bytes) -> None:
        """Move an entry to the dead-letter stream with `error`, ack and delete it (one script)."""
        await self._dead(keys=[self.names.trajectories, self.names.dead_letter],
                         args=[self.names.consumer_group, entry_id, error, payload, self.consumer,
                               repr(time.time()), DEAD_LETTER_MAXLEN])
        self.stats.dead_lettered += 1
        log.warning("dead-lettered trajectory entry %s: %s", entry_id, error)


@dataclass
class DeadLetter:
    """One dead-letter entry (for inspection tools and tests)."""

    entry_id: str
    source_id: str
    error: str
    payload: bytes
    consumer: str
    time: float
    fields: dict[str, bytes] = field(default_factory=dict, repr=False)


async def read_dead_letters(redis: aioredis.Redis, names: StreamNames, count: int = 100) -> list[DeadLetter]:
    """The oldest `count` dead-letter entries of a job."""
    out = []
    entries: Any = await redis.xrange(names.dead_letter, count=count)
    for raw_id, f in entries:
        out.append(DeadLetter(entry_id=_s(raw_id), source_id=_s(f.get(b"source_id", b"")),
                              error=_s(f.get(b"error", b"")), payload=f.get(b"payload", b""),
                              consumer=_s(f.get(b"consumer", b"")),
                              time=float(f.get(b"time", b"0") or 0), fields=f))
    return out


async def trained_ids(redis: aioredis.Redis, names: StreamNames) -> set[str]:
    """The group ids marked trained and not yet pruned (for inspection tools and tests)."""
    return {_s(gid) for gid in await redis.zrange(names.trained, 0, -1)}
