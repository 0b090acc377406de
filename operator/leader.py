"""Leader election on a coordination.k8s.io/v1 Lease, so that of several operator replicas exactly
one reconciles and a standby takes over when it dies.

Why a Lease and not kopf's peering (KopfPeering objects, `--peering`, priorities): kopf's peering
is a pause signal for a developer's operator, not an election. Replicas of the same priority pause
*all* of them ("Pausing all operators, including self"); peers write their keep-alives with plain
merge patches, so two replicas starting together can both see no rival and both run until the
watch event of the other arrives; and a pause stops kopf's watch-streams, not the per-job worker
tasks this operator runs (asyncrl.operator.handlers.JobWorker). A Lease updated by PUT with a
`resourceVersion` precondition is a compare-and-swap on the API server, the protocol of client-go's
and controller-runtime's leader election, which we follow:

- A candidate takes the Lease when it is free (no holder: its holder let it go) or when its record
  (holder, renewTime) has not changed for `leaseDurationSeconds` *as this candidate has watched it*
  (its own monotonic clock; the other host's clock is never trusted), by a PUT carrying the
  resourceVersion it read. Of two candidates at most one PUT succeeds; the other gets 409.
- The leader renews every `retry_period` seconds. If it has not renewed successfully for
  `renew_deadline` seconds (counted from when the last successful renewal was *sent*), or finds
  someone else holding the Lease, it is no longer sure to be the only one, and the process exits at
  once (`os._exit`, like a controller-runtime manager), before any standby can have waited out the
  `lease_duration` (> renew_deadline) that it needs to take over.
- A leader that stops cleanly (SIGTERM: a rolling update, a scale-down) releases the Lease (holder
  emptied), so a standby takes over within one `retry_period` instead of a lease duration.

The standby runs nothing else: kopf starts (watches, handlers, workers) only once the Lease is held.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.operator.kube import ApiError, Kube, Obj

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "asyncrl-operator"


@dataclass(frozen=True)
class ElectionSettings:
    """Timing as in client-go (defaults 15 / 10 / 2 s): renew_deadline < lease_duration."""

    namespace: str
    identity: str
    name: str = DEFAULT_LEASE_NAME
    lease_duration: float = 15.0
    """Seconds a standby waits, from the last change it saw, before it takes a Lease that is not renewed."""
    renew_deadline: float = 10.0
    """Seconds a leader keeps going without a successful renewal before it exits."""
    retry_period: float = 2.0
    """Seconds between renewals, and between a standby's attempts."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration "
                             f"(got {self.retry_period}, {self.renew_deadline}, {self.lease_duration})")


def micro_time(at: float | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    moment = datetime.datetime.fromtimestamp(time.time() if at is None else at, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    """The pod's name (downward API POD_NAME) when in a pod, else host and pid: unique per process."""
    pod = os.environ.get("POD_NAME")
    return pod or f"{os.uname().nodename}-{os.getpid()}"


@dataclass
class LeaderElector:
    """Acquire, renew and release one Lease (see the module doc for the protocol)."""

    kube: Kube
    settings: ElectionSettings
    on_lost: Callable[[str], None] = field(default=lambda reason: _exit_now(reason))
    _held: Obj | None = field(default=None, init=False)
    """The Lease as our last successful write returned it (its resourceVersion is the precondition)."""
    _seen: tuple[str, str] | None = field(default=None, init=False)
    _seen_at: float = field(default=0.0, init=False)

    def _spec(self, *, now: str, acquire: str, transitions: int, holder: str | None = None,
              duration: float | None = None) -> Obj:
        s = self.settings
        return {"holderIdentity": s.identity if holder is None else holder,
                "leaseDurationSeconds": max(1, round(s.lease_duration if duration is None else duration)),
                "acquireTime": acquire, "renewTime": now, "leaseTransitions": transitions}

    def _expired(self, lease: Obj) -> bool:
        """Free, or unchanged for a lease duration by our own clock since we first saw this record."""
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if not holder:
            return True
        record = (holder, str(spec.get("renewTime") or ""))
        now = time.monotonic()
        if record != self._seen:
            self._seen, self._seen_at = record, now
            return False
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration)
        return now - self._seen_at > duration

    async def try_acquire(self) -> bool:
        """One attempt; True once this process holds the Lease."""
        s = self.settings
        lease = await self.kube.get("Lease", s.namespace, s.name)
        now = micro_time()
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": self._spec(now=now, acquire=now, transitions=0)}
            try:
                self._held = await self.kube.create(body)
            except ApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != s.identity and not self._expired(lease):
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if spec.get("holderIdentity") != s.identity:
            transitions += 1
        lease["spec"] = self._spec(now=now, acquire=now, transitions=transitions)
        try:
            self._held = await self.kube.replace(lease)  # carries the resourceVersion we read: CAS
        except ApiError as exc:
            if exc.status == 409:  # someone else wrote it since we read it
                return False
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this process is the leader."""
        s = self.settings
        log.info(f"leader election: {s.identity} waiting for Lease {s.namespace}/{s.name}")
        while True:
            try:
                if await self.try_acquire():
                    log.info(f"leader election: {s.identity} holds Lease {s.namespace}/{s.name}")
                    return
            except (ApiError, OSError) as exc:
                log.warning(f"leader election: cannot read or write the Lease: {exc}")
            await asyncio.sleep(s.retry_period)

    async def _renew_once(self) -> None:
        s = self.settings
        assert self._held is not None
        lease = dict(self._held)
        spec = dict(lease.get("spec") or {})
        spec.update(renewTime=micro_time(), holderIdentity=s.identity,
                    leaseDurationSeconds=max(1, round(s.lease_duration)))
        lease["spec"] = spec
        try:
            self._held = await self.kube.replace(lease)
        except ApiError as exc:
            if exc.status != 409:
                raise
            current = await self.kube.get("Lease", s.namespace, s.name)
            holder = ((current or {}).get("spec") or {}).get("holderIdentity")
            if holder != s.identity:
                raise LostLease(f"Lease {s.namespace}/{s.name} is held by {holder or 'nobody'}") from None
            self._held = current
            raise

    async def keep(self, stop: threading.Event) -> None:
        """Renew until `stop` is set; call on_lost (default: exit the process) when leadership is lost."""
        s = self.settings
        last_ok = time.monotonic()
        while not stop.is_set():
            sent = time.monotonic()
            remaining = last_ok + s.renew_deadline - sent
            try:
                await asyncio.wait_for(self._renew_once(), timeout=max(0.0, remaining))
                last_ok = sent
            except LostLease as exc:
                self.on_lost(str(exc))
                return
            except (ApiError, OSError, asyncio.TimeoutError) as exc:
                log.warning(f"leader election: renewal failed: {exc!r}")
            if time.monotonic() - last_ok >= s.renew_deadline:
                self.on_lost(f"no successful renewal of Lease {s.namespace}/{s.name} for {s.renew_deadline}s")
                return
            await asyncio.sleep(min(s.retry_period, max(0.0, last_ok + s.renew_deadline - time.monotonic())))

    async def release(self) -> None:
        """Give the Lease up (holder emptied) so a standby takes over at once; only if still ours."""
        s = self.settings
        if self._held is None:
            return
        lease = dict(self._held)
        spec = dict(lease.get("spec") or {})
        spec.update(holderIdentity="", renewTime=micro_time(), leaseDurationSeconds=1)
        lease["spec"] = spec
        try:
            await self.kube.replace(lease)
            log.info(f"leader election: {s.identity} released Lease {s.namespace}/{s.name}")
        except (ApiError, OSError) as exc:  # lost meanwhile, or the API is gone: it expires by itself
            log.warning(f"leader election: could not release the Lease: {exc}")
        self._held = None


class LostLease(Exception):
    """Someone else holds the Lease this process believed it held."""


def _exit_now(reason: str) -> None:
    """Leave at once: another replica may take over after the lease duration, and nothing of this
    process may reconcile after that. No cleanup, no kopf shutdown: those could outlast the margin."""
    log.error(f"leader election: leadership lost ({reason}): exiting")
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(3)


class Renewer:
    """Runs LeaderElector.keep in a daemon thread with its own event loop, beside kopf's loop in the
    main thread, so a busy or stuck operator loop never delays a renewal (or the exit)."""

    def __init__(self, elector: LeaderElector):
        self.elector = elector
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(elector.keep(self.stop)),
                                       name="asyncrl-leader-renewal", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        """Stop renewing (the operator has stopped), then release the Lease."""
        self.stop.set()
        self.thread.join(timeout=self.elector.settings.renew_deadline)
        asyncio.run(self.elector.release())
