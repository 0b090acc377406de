"""Which dependencies this process is waiting for, and how long to wait between two attempts.

Why its own module: the Redis clients (asyncrl.transport.connection) and the rollout worker's engine
client both wait out outages and report them to one board, which the trainer serves on /status
(trainer/report/status_api.py) and the operator turns into the job's Degraded condition (operator/status.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("asyncrl.infra.health")

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
"""The longest pause between two attempts: after Redis is back, a waiting command notices
within this long."""
STILL_DOWN_LOG_S = 10.0
"""While a dependency stays unreachable, repeat the warning this often (not at every attempt)."""


def backoff_delay(failures: int, *, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait after the `failures`-th failure in a row: exponential, capped, jittered.

    "Equal jitter": a random point in the upper half of min(cap, base * 2^failures). Jitter spreads
    the reconnects of many clients (every worker lost Redis at the same instant); the lower bound
    keeps a client from retrying in a tight loop."""
    ceiling = min(cap, base * 2 ** min(max(failures, 1), 30))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


# ------------------------------------------------------------------------------------ Degraded


def dependency_name(dependency: str) -> str:
    """How a dependency is named in log lines and condition messages ("Redis", "engine")."""
    return "Redis" if dependency == "redis" else dependency


@dataclass(frozen=True)
class Outage:
    """One dependency this process cannot reach right now (what Degraded shows)."""

    dependency: str
    """"redis" or "engine"."""
    target: str
    """Where: host:port/db for Redis, the URL for an engine (never a password)."""
    since: float
    """Unix time of the first failure of this outage."""
    last_error: str
    failures: int
    window_s: float
    """How long a request keeps retrying before it fails (the component then gives up)."""

    def seconds(self, now: float | None = None) -> float:
        return max((time.time() if now is None else now) - self.since, 0.0)

    def describe(self, now: float | None = None) -> str:
        name = dependency_name(self.dependency)
        return (f"{name} {self.target} unreachable for {self.seconds(now):.0f}s ({self.last_error}); "
                f"retrying for up to {self.window_s:.0f}s")

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        return {"dependency": self.dependency, "target": self.target, "since": self.since,
                "seconds": round(self.seconds(now), 3), "last_error": self.last_error,
                "failures": self.failures, "window_s": self.window_s}


REASONS = {"redis": "RedisUnavailable", "engine": "EngineUnavailable"}
"""The Degraded condition's reason per dependency (several at once: the first listed here wins)."""


class Health:
    """Which dependencies this process is waiting for: Degraded while any is listed.

    Thread-safe: clients write it from the event loop, the trainer's status endpoint reads it from
    its own thread. Transitions are logged (WARNING when an outage starts, repeated every
    STILL_DOWN_LOG_S while it lasts; INFO with its length when it ends)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outages: dict[tuple[str, str], Outage] = {}
        self._logged: dict[tuple[str, str], float] = {}
        self.outages_total = 0
        """Outages that began in this process (ended or not)."""

    def failing(self, dependency: str, target: str, error: BaseException | str, window_s: float) -> Outage:
        """Record a failed attempt to reach `target`; returns the outage it belongs to."""
        key = (dependency, target)
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        now = time.time()
        with self._lock:
            old = self._outages.get(key)
            outage = Outage(dependency, target, old.since if old else now, text,
                            (old.failures if old else 0) + 1, window_s)
            self._outages[key] = outage
            if old is None:
                self.outages_total += 1
            last_log = self._logged.get(key)
            speak = last_log is None or now - last_log >= STILL_DOWN_LOG_S
            if speak:
                self._logged[key] = now
        if speak:
            log.warning("degraded: %s", outage.describe(now))
        return outage

    def recovered(self, dependency: str, target: str) -> Outage | None:
        """`target` answered again: the outage (if there was one) ends."""
        key = (dependency, target)
        if key not in self._outages:  # the common case, without taking the lock
            return None
        with self._lock:
            outage = self._outages.pop(key, None)
            self._logged.pop(key, None)
        if outage is not None:
            name = dependency_name(dependency)
            log.info("%s %s reachable again after %.1fs (%d failed attempt(s))%s", name, target,
                     outage.seconds(), outage.failures, "" if self.degraded() else ": no longer degraded")
        return outage

    def is_failing(self, dependency: str, target: str) -> bool:
        return (dependency, target) in self._outages

    def outages(self) -> list[Outage]:
        """The current outages, oldest first."""
        with self._lock:
            return sorted(self._outages.values(), key=lambda o: o.since)

    def degraded(self) -> bool:
        return bool(self._outages)

    def condition(self) -> dict[str, Any]:
        """The Degraded condition as served on /status: `status` (bool), `reason`
        (RedisUnavailable, EngineUnavailable), `message`, `since` (Unix time) and each outage."""
        outages = self.outages()
        now = time.time()
        if not outages:
            return {"status": False, "reason": "", "message": "", "since": None, "outages": []}
        kinds = {o.dependency for o in outages}
        reason = next((r for dep, r in REASONS.items() if dep in kinds), "DependencyUnavailable")
        return {"status": True, "reason": reason, "message": "; ".join(o.describe(now) for o in outages),
                "since": outages[0].since, "outages": [o.to_json(now) for o in outages]}

    def summary(self) -> str:
        """One short phrase for a progress line: "no", or what is down and for how long."""
        outages = self.outages()
        if not outages:
            return "no"
        return ",".join(f"{o.dependency}({o.seconds():.0f}s)" for o in outages)

    def clear(self) -> None:
        """Forget every outage (tests; a process that starts over)."""
        with self._lock:
            self._outages.clear()
            self._logged.clear()


HEALTH = Health()
"""This process's board: every client made here reports to it unless given another."""
