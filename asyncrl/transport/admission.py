"""Global staleness admission (AReaL's capacity rule, in prompt-group units), shared by all pods.

A rollout group may start iff

    min(max_concurrent - running, (version + 1) * B + ahead - (accepted + running)) > 0

where `version` is the trainer's policy version, `B` the train batch size in groups, `running`
the live leases of all pods, `accepted` the groups produced for training so far and `ahead` the
groups the staleness policy lets rollout run ahead (`StalenessPolicy.groups_ahead`,
asyncrl/api/staleness.py): eta * B for the
global-budget policy (AReaL's `(eta + version + 1) * B`), ceil(alpha * B) for the per-sample policy
(ROLL Flash's asynchronous ratio alpha; fractional alpha admits a fraction of a batch). Each check
and its lease grant happen in one Lua script, so N pods together never exceed the bound; there
are no per-pod counters.

Accounting (all in the job's `admission` hash and `admission-leases` sorted set):
- `try_acquire` adds a lease (expiry in server time); expired leases are removed by every script
  before counting, so a crashed pod's slot comes back after `lease_seconds` (`renew` extends).
- `release(accepted=True)` moves the lease to `accepted` atomically (running -1, accepted +1):
  call it after the group was published. `release(accepted=False)` frees the slot (aborted or
  failed group). A repeated release of the same lease (a retry after a lost reply) is a no-op; a
  release after the lease expired still counts the published group as accepted.
- `accepted` is cumulative: the trainer consumes B groups per step and bumps `version` by 1
  (`set_version`), which admits B more. When the trainer drops n groups as too stale they were
  accepted but never trained, so `record_dropped(n)` subtracts them from `accepted`; otherwise
  producers would be short of n slots forever and the trainer could wait for a batch that the
  bound never lets anyone produce (the per-sample policy's discards too: ROLL's own scheduler
  keeps their slots spent; docs/trainer.md says why we do not). The same holds for groups the
  trainer dead-letters (undecodable or untrainable): `record_dead_lettered(n)` (counted apart, in
  `dead_lettered`).
- eta = 0 (or alpha = 0) is synchronous RL: only B groups per version can be produced.

Nothing can leak for good (`reconcile`, run by the trainer at each step and while it waits): every
accepted group is either still in the trajectory stream (undelivered, buffered or trained but not
yet acked) or was trained and acked, so `accepted` must lie within
`[trained_acked + XLEN - running, trained_acked + XLEN]` (the `running` slack: a producer XADDs
before it releases its lease). Outside it, `accepted` has drifted: groups counted but gone (a write
Redis lost, a dead letter or drop never reported) hold capacity that no producer gets back, which
at eta = 0 deadlocks the job; groups published but never counted (a release lost past its retries)
loosen the bound. A drift seen by two checks in a row is repaired (counted in `drift_lost` /
`drift_found`); a one-off (a release landing between the two reads) never is.

A producer that drops a group (its reward or its episodes failed, or its generation kept failing) or
queues its prompt again (its engine went away) releases its lease unaccepted and counts it with the
error's text (`record_failure`, FAILURE_CAUSES): job-wide, so the trainer's /status shows the counts and,
when training stands still, names the dominant cause with its last error (trainer/report/stall.py).

A restarted rollout worker keeps its name (the pod's), so `release_holder` at its start returns
the leases its dead predecessor held at once; their expiry stays the backstop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import redis.asyncio as aioredis

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames

if TYPE_CHECKING:  # (the spec imports the runtime, which imports this package)
    from asyncrl.api.spec import AsyncRLJobSpec

RELEASED_RETENTION_MS = 3_600_000
"""How long released lease ids are remembered, to make a retried release a no-op."""

# Common prologue: server time in ms, drop expired leases and old released-lease records.
_PROLOGUE = f"""
local state, leases, released = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
redis.call('ZREMRANGEBYSCORE', released, '-inf', now - {RELEASED_RETENTION_MS})
local version = tonumber(redis.call('HGET', state, 'version') or '0')
local accepted = tonumber(redis.call('HGET', state, 'accepted') or '0')
"""

# ARGV: lease_id, max_concurrent, ahead (groups), batch_size, lease_ms -> {granted, version, accepted, running}
_ACQUIRE_LUA = _PROLOGUE + """
local lease, max_concurrent, ahead, b, lease_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
    tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('ZSCORE', leases, lease) then  -- retry of a call that already succeeded
  redis.call('ZADD', leases, 'XX', now + lease_ms, lease)
  return {1, version, accepted, redis.call('ZCARD', leases)}
end
local running = redis.call('ZCARD', leases)
local capacity = math.min(max_concurrent - running, (version + 1) * b + ahead - (accepted + running))
if capacity > 0 then
  redis.call('ZADD', leases, now + lease_ms, lease)
  return {1, version, accepted, running + 1}
end
return {0, version, accepted, running}
"""

# ARGV: lease_id, accepted (1|0) -> 1 lease was live, 0 it had expired, 2 already released
_RELEASE_LUA = _PROLOGUE + """
local lease = ARGV[1]
if redis.call('ZSCORE', released, lease) then return 2 end
local live = redis.call('ZREM', leases, lease)
redis.call('ZADD', released, now, lease)
if ARGV[2] == '1' then redis.call('HINCRBY', state, 'accepted', 1) end
return live
"""

# ARGV: lease_id, lease_ms -> 1 renewed, 0 expired or unknown
_RENEW_LUA = _PROLOGUE + """
if redis.call('ZSCORE', leases, ARGV[1]) then
  redis.call('ZADD', leases, 'XX', now + tonumber(ARGV[2]), ARGV[1])
  return 1
end
return 0
"""

# ARGV: n, counter ('dropped' | 'dead_lettered') -> accepted after the change (never below -running:
# a producer XADDs before it releases its lease, so a group can be dropped before it is counted; the
# release that follows brings `accepted` back, where a floor of 0 would leave it one group too high)
_DROPPED_LUA = _PROLOGUE + """
local n = tonumber(ARGV[1])
local new = math.max(accepted - n, -redis.call('ZCARD', leases))
redis.call('HSET', state, 'accepted', new)
redis.call('HINCRBY', state, ARGV[2], n)
return new
"""

# ARGV: holder -> leases of `holder` released (not accepted): those of a dead predecessor
_RELEASE_HOLDER_LUA = _PROLOGUE + """
local prefix = ARGV[1] .. '/'
local n = 0
for _, lease in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
  if string.sub(lease, 1, #prefix) == prefix then
    redis.call('ZREM', leases, lease)
    redis.call('ZADD', released, now, lease)
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', state, 'leases_returned', n) end
return n
"""

# KEYS[4]: the trajectory stream. ARGV: trained_acked, repair (signed; 0: only measure).
# -> {drift, repaired}: drift < 0 accepted counts groups that exist nowhere, > 0 groups exist that
# it does not count (beyond the running leases); `repair` moves accepted toward the band by at most
# |repair|, only in the drift's direction.
_RECONCILE_LUA = _PROLOGUE + """
local running = redis.call('ZCARD', leases)
local present = tonumber(ARGV[1]) + redis.call('XLEN', KEYS[4])
local drift = 0
if accepted > present then drift = present - accepted
elseif accepted + running < present then drift = present - accepted - running end
local repair = tonumber(ARGV[2])
local applied = 0
if drift < 0 and repair < 0 then applied = math.max(drift, repair)
elseif drift > 0 and repair > 0 then applied = math.min(drift, repair) end
if applied ~= 0 then
  redis.call('HINCRBY', state, 'accepted', applied)
  redis.call('HINCRBY', state, applied < 0 and 'drift_lost' or 'drift_found', math.abs(applied))
end
return {drift, applied}
"""

FailureCause = Literal["reward_failures", "episode_failures", "generation_failures", "engine_requeues"]
"""What a producer counts when a group is not published (`record_failure`)."""
FAILURE_CAUSES: tuple[FailureCause, ...] = ("reward_failures", "episode_failures", "generation_failures",
                                            "engine_requeues")
LAST_ERROR_CHARS = 500
"""How much of a failure's text is kept (the newest per cause)."""


def last_error_field(cause: str) -> str:
    """The admission hash field holding the newest error text of `cause`."""
    return f"last_error:{cause}"


# -> {version, accepted, running, dropped, dead_lettered, drift_lost, drift_found, leases_returned,
#     *FAILURE_CAUSES, *their last errors}
_SNAPSHOT_LUA = _PROLOGUE + """
local out = {version, accepted, redis.call('ZCARD', leases)}
for _, field in ipairs({'dropped', 'dead_lettered', 'drift_lost', 'drift_found', 'leases_returned',
                        """ + ", ".join(f"'{c}'" for c in FAILURE_CAUSES) + """}) do
  table.insert(out, tonumber(redis.call('HGET', state, field) or '0'))
end
for _, field in ipairs({""" + ", ".join(f"'{last_error_field(c)}'" for c in FAILURE_CAUSES) + """}) do
  table.insert(out, redis.call('HGET', state, field) or '')
end
return out
"""


def admission_capacity(version: int, accepted: int, running: int, *, batch_size: int, staleness: StalenessPolicy,
                       max_concurrent: int) -> int:
    """How many more groups may start now (the rule above; <= 0: none)."""
    ahead = staleness.groups_ahead(batch_size)
    return min(max_concurrent - running, (version + 1) * batch_size + ahead - (accepted + running))


@dataclass
class AdmissionSnapshot:
    """Admission state as seen at one instant (capacity clamped at 0)."""

    version: int
    accepted: int
    running: int
    capacity: int
    dropped: int = 0
    dead_lettered: int = 0
    drift_lost: int = 0
    """Groups `reconcile` took out of `accepted`: counted, but neither in the stream nor trained."""
    drift_found: int = 0
    """Groups `reconcile` added to `accepted`: in the stream, but never counted."""
    leases_returned: int = 0
    """Leases of dead workers returned by their replacement (`release_holder`)."""
    reward_failures: int = 0
    """Groups producers dropped because a reward could not be computed (`record_failure`)."""
    episode_failures: int = 0
    """Groups producers dropped because an episode function failed past its retries (`record_failure`)."""
    generation_failures: int = 0
    """Groups producers dropped because a sample kept failing on the engine or the group could not
    be trained (`record_failure`)."""
    engine_requeues: int = 0
    """Groups interrupted because their engine went away (unreachable, or aborting again and again),
    their prompts queued again (`record_failure`)."""
    last_errors: dict[str, str] = field(default_factory=dict)
    """Failure cause (FAILURE_CAUSES) -> the newest error text recorded for it (absent: none yet)."""


@dataclass
class Drift:
    """One `reconcile` check: the drift measured and how much of it was repaired (signed)."""

    drift: int
    repaired: int


class Admission:
    """One pod's handle on its job's global admission state.

    `staleness` is the job's policy, whole: admission counts its groups ahead, and the trainer's
    inbox and the engines' view read their bound from it here, so the three never disagree."""

    def __init__(self, redis: aioredis.Redis, names: StreamNames, *, batch_size: int, staleness: StalenessPolicy,
                 max_concurrent: int, lease_seconds: float = 120) -> None:
        if batch_size < 1 or max_concurrent < 1 or lease_seconds <= 0:
            raise ValueError(f"invalid admission settings: batch_size={batch_size}, "
                             f"max_concurrent={max_concurrent}, lease_seconds={lease_seconds}")
        self.redis = redis
        self.names = names
        self.batch_size = batch_size
        self.staleness = staleness
        self.max_concurrent = max_concurrent
        self.lease_ms = max(int(lease_seconds * 1000), 1)
        self._keys = [names.admission, names.admission_leases, names.admission_released]
        self._stream = names.trajectories
        self._acquire = redis.register_script(_ACQUIRE_LUA)
        self._release = redis.register_script(_RELEASE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._dropped = redis.register_script(_DROPPED_LUA)
        self._snapshot = redis.register_script(_SNAPSHOT_LUA)
        self._release_holder = redis.register_script(_RELEASE_HOLDER_LUA)
        self._reconcile = redis.register_script(_RECONCILE_LUA)

    async def try_acquire(self, holder: str) -> str | None:
        """A lease id if a group may start now, else None. Safe to retry (idempotent)."""
        lease_id = f"{holder}/{uuid.uuid4().hex}"
        granted, *_ = await self._acquire(
            keys=self._keys,
            args=[lease_id, self.max_concurrent, self.staleness.groups_ahead(self.batch_size), self.batch_size,
                  self.lease_ms])
        return lease_id if int(granted) == 1 else None

    async def acquire(self, holder: str, poll_s: float = 0.05, timeout: float | None = None) -> str:
        """Block until a group may start; raises TimeoutError after `timeout` s (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            lease = await self.try_acquire(holder)
            if lease is not None:
                return lease
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no admission for {holder} within {timeout}s")
            await asyncio.sleep(poll_s)

    async def renew(self, lease_id: str) -> bool:
        """Extend a live lease by `lease_seconds` from now; False if it had already expired."""
        return int(await self._renew(keys=self._keys, args=[lease_id, self.lease_ms])) == 1

    async def release(self, lease_id: str, *, accepted: bool) -> bool:
        """End a lease; `accepted=True` after the group was published. False if it had expired."""
        code = int(await self._release(keys=self._keys, args=[lease_id, "1" if accepted else "0"]))
        return code != 0

    async def release_holder(self, holder: str) -> int:
        """At a worker's start: release every lease still held under its name (its predecessor died
        holding them; their groups were never published, or are counted by `reconcile`)."""
        return int(await self._release_holder(keys=self._keys, args=[holder]))

    async def reconcile(self, trained_acked: int, repair: int = 0) -> Drift:
        """Trainer: measure how far `accepted` is from what the stream and `trained_acked` (groups
        trained and acknowledged, so gone from the stream) say; move it back by at most `repair`
        (signed, only in the drift's direction). The top of this module says when to repair."""
        drift, applied = await self._reconcile(keys=[*self._keys, self._stream], args=[int(trained_acked), int(repair)])
        return Drift(drift=int(drift), repaired=int(applied))

    async def set_version(self, v: int) -> None:
        """Trainer: the policy version is now `v` (admits B more groups per increment)."""
        await self.redis.hset(self.names.admission, "version", int(v))

    async def record_dropped(self, n: int) -> int:
        """Trainer: `n` accepted groups were dropped as too stale; give their capacity back."""
        return await self._give_back(n, "dropped")

    async def record_dead_lettered(self, n: int) -> int:
        """Trainer: `n` accepted groups went to the dead-letter stream (never trained); give their
        capacity back. Two dead-lettered copies of one publish (a producer retry) give back two
        slots for one: the bound is loosened by one group, never tightened."""
        return await self._give_back(n, "dead_lettered")

    async def record_failure(self, cause: FailureCause, error: str) -> None:
        """Producer: a group was not published, for `cause` (FAILURE_CAUSES), with `error`'s text.
        Its lease is released unaccepted, so no capacity is held: this only counts it, job-wide, and
        keeps the newest error of each cause (what a stalled job's report quotes)."""
        if cause not in FAILURE_CAUSES:
            raise ValueError(f"unknown failure cause {cause!r}; one of {', '.join(FAILURE_CAUSES)}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.names.admission, cause, 1)
            pipe.hset(self.names.admission, last_error_field(cause), error[:LAST_ERROR_CHARS])
            await pipe.execute()

    async def _give_back(self, n: int, counter: str) -> int:
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return (await self.snapshot()).accepted
        return int(await self._dropped(keys=self._keys, args=[n, counter]))

    @classmethod
    def for_job(cls, redis: aioredis.Redis, names: StreamNames, spec: AsyncRLJobSpec) -> Admission:
        """The job's admission as its spec sets it (batch size, staleness policy, concurrency)."""
        return cls(redis, names, batch_size=spec.algorithm.batch_size, staleness=spec.staleness.as_policy(),
                   max_concurrent=spec.max_concurrent_groups())

    async def snapshot(self) -> AdmissionSnapshot:
        """Current version, accepted, running (expired leases excluded) and free capacity."""
        raw = await self._snapshot(keys=self._keys, args=[])
        counts, errors = raw[:-len(FAILURE_CAUSES)], raw[-len(FAILURE_CAUSES):]
        version, accepted, running, dropped, dead, lost, found, returned, *failures = (int(x) for x in counts)
        cap = admission_capacity(version, accepted, running, batch_size=self.batch_size, staleness=self.staleness,
                                 max_concurrent=self.max_concurrent)
        last: dict[str, str] = {cause: text.decode() if isinstance(text, bytes) else str(text)
                for cause, text in zip(FAILURE_CAUSES, errors, strict=True) if text}
        return AdmissionSnapshot(version=version, accepted=accepted, running=running, capacity=max(cap, 0),
                                 dropped=dropped, dead_lettered=dead, drift_lost=lost, drift_found=found,
                                 leases_returned=returned, last_errors=last,
                                 **dict(zip(FAILURE_CAUSES, failures, strict=True)))
