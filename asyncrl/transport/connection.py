"""Connect to Redis (redis:// or rediss:// with a password) and ride out its outages.

Why: rollout pods and the trainer outlive Redis restarts, failovers and network blips. A client
that gives up after a fixed number of retries turns every outage longer than its budget into a
crash of every component at once (measured with the old 10 retries: outages over ~10 s killed
the trainer, losing its unacknowledged steps, and every worker). So every command is retried on
connection and timeout errors for an outage *window* (default 180 s, `ASYNCRL_REDIS_OUTAGE_S` or
the components' `--redis-outage-s`), with capped exponential backoff and jitter: a command issued
during an outage blocks until Redis answers again instead of raising, and only an outage longer
than the window fails it (the pod then restarts: the backstop, not the plan).

While a command waits, the process is *Degraded*: the process-wide board (`asyncrl.infra.health.HEALTH`) records which
dependency is unreachable, since when and why (rollout workers log it and show it in their
progress line; the trainer serves it on /status, trainer/report/status_api.py). The engine clients of the
rollout worker report to the same board (rollout/worker/worker.py).

At start-up, an unreachable Redis still fails with RedisUnavailableError naming the host, port and
what was tried, after `connect`'s own short timeout, instead of a bare socket error deep inside a
worker loop: a wrong URL should be reported in seconds, not after the outage window.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, NoBackoff
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError, TimeoutError

from asyncrl.infra.errors import TransportError
from asyncrl.infra.health import BACKOFF_BASE_S, BACKOFF_CAP_S, HEALTH, Health, backoff_delay

log = logging.getLogger("asyncrl.transport.connection")

T = TypeVar("T")

ENV_REDIS_OUTAGE_S = "ASYNCRL_REDIS_OUTAGE_S"
"""Environment variable: seconds a Redis command keeps retrying through an outage."""
DEFAULT_OUTAGE_S = 180.0
"""Long enough for a Redis pod to be rescheduled and reload its AOF; short enough that a Redis
that is really gone ends in a restart the operator counts."""
DEFAULT_SOCKET_TIMEOUT_S = 30.0
"""Must exceed the longest BLOCK we issue (reads block at most a few seconds)."""

_process_outage_s: float | None = None


def set_outage_window(seconds: float | None) -> None:
    """Set this process's default outage window (a component's --redis-outage-s); None: the
    environment's, else DEFAULT_OUTAGE_S. Clients made before the call keep theirs."""
    global _process_outage_s
    if seconds is not None and seconds < 0:
        raise ValueError(f"the outage window must be >= 0 seconds, got {seconds}")
    _process_outage_s = seconds


def outage_window() -> float:
    """Seconds a Redis command keeps retrying: set_outage_window's, else $ASYNCRL_REDIS_OUTAGE_S,
    else DEFAULT_OUTAGE_S."""
    if _process_outage_s is not None:
        return _process_outage_s
    raw = os.environ.get(ENV_REDIS_OUTAGE_S, "").strip()
    if not raw:
        return DEFAULT_OUTAGE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_REDIS_OUTAGE_S} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV_REDIS_OUTAGE_S} must be >= 0 seconds, got {raw!r}")
    return value




# ------------------------------------------------------------------------------------ retrying

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("asyncrl_redis_retry_deadline",
                                                                          default=None)
"""The deadline of the outermost retry in progress in this task. redis-py nests retries (a
command's retry reconnects, and the reconnect has its own): the inner ones share the outer
deadline, so one command waits out one window, not one per level."""


class _Backoff(AbstractBackoff):
    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap

    def compute(self, failures: int) -> float:
        return backoff_delay(failures, base=self.base, cap=self.cap)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Backoff) and (self.base, self.cap) == (other.base, other.cap)

    def __hash__(self) -> int:
        return hash((self.base, self.cap))


def _being_cancelled() -> bool:
    """True inside a task that has a cancellation request pending (Python 3.11+; else False)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling and cancelling())


def reraise_if_cancelled(error: BaseException) -> None:
    """For the `except Exception` of a task's retry loop: redis-py turns a cancellation that lands
    inside a command into a connection error; logged and retried, it is spent, and the task (a
    lease renewal, a heartbeat) outlives its owner's cancel() and holds the event loop's shutdown."""
    if _being_cancelled():
        raise asyncio.CancelledError() from error


class OutageRetry(Retry):
    """redis-py's Retry, bounded by time (the outage window) rather than a count.

    Each failed attempt marks the dependency failing on the `health` board; the outermost call
    that succeeds marks it recovered. `retries` >= 0 also bounds the count (a short-lived probe
    such as the operator's); -1 = as many as fit in the window."""

    def __init__(self, *, window_s: float, target: str, health: Health | None = HEALTH, retries: int = -1,
                 base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> None:
        super().__init__(_Backoff(base_s, cap_s), retries)
        self.window_s = window_s
        self.target = target
        self.health = health

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        # redis-py deep-copies the policy into every connection; it holds no per-call state, and the
        # copies must keep reporting to the same board.
        return self

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, OutageRetry) and super().__eq__(other)
                and (self.window_s, self.target) == (other.window_s, other.target))

    __hash__ = Retry.__hash__

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Callable[..., Any],
                              is_retryable: Callable[[Exception], bool] | None = None,
                              with_failure_count: bool = False) -> T:
        outer = _deadline.get()
        token = _deadline.set(time.monotonic() + self.window_s) if outer is None else None
        deadline = _deadline.get() or 0.0
        failures = 0
        try:
            while True:
                try:
                    result = await do()
                except self._supported_errors as error:
                    # the caller being cancelled (e.g. a worker shutting down), turned into a connection
                    # error by the library: waiting out an "outage" would swallow the cancellation
                    reraise_if_cancelled(error)
                    if is_retryable and not is_retryable(error):
                        raise
                    failures += 1
                    if self.health is not None:
                        self.health.failing("redis", self.target, error, self.window_s)
                    if with_failure_count:
                        await fail(error, failures)
                    else:
                        await fail(error)
                    delay = self._backoff.compute(failures)
                    if (self._retries >= 0 and failures > self._retries) or time.monotonic() + delay > deadline:
                        raise error
                    await asyncio.sleep(delay)
                else:
                    if token is not None and self.health is not None:
                        self.health.recovered("redis", self.target)
                    return result
        finally:
            if token is not None:
                _deadline.reset(token)


class RedisUnavailableError(TransportError, ConnectionError):
    """Redis could not be reached (or refused our credentials) when a component started."""


@dataclass(frozen=True)
class Endpoint:
    """What a Redis URL points at, with the password redacted (safe to log)."""

    scheme: str
    host: str
    port: int
    db: int
    tls: bool
    has_password: bool

    def describe(self) -> str:
        return (f"{self.scheme}://{self.host}:{self.port}/{self.db} "
                f"(TLS {'on' if self.tls else 'off'}, password {'set' if self.has_password else 'not set'})")


def parse_endpoint(url: str) -> Endpoint:
    """Host, port, db and security settings of a redis:// or rediss:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"Redis URL must start with redis:// or rediss://, got {parts.scheme or url!r}")
    path = unquote(parts.path).strip("/")
    try:
        db = int(path) if path else 0
        port = parts.port or 6379
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {parts.scheme}://{parts.hostname}...: {exc}") from None
    return Endpoint(scheme=parts.scheme, host=parts.hostname or "localhost", port=port, db=db,
                    tls=parts.scheme == "rediss", has_password=parts.password is not None)


PROCESS_HEALTH: Any = "process"
"""`health=` default: HEALTH for clients that wait out outages; none for a count-bounded probe
(the operator's reads of a job's Redis are not a dependency its own process waits for)."""


def retry_policy(*, outage_s: float | None = None, retries: int = -1, target: str = "redis",
                 health: Health | None = PROCESS_HEALTH, backoff_cap_s: float = BACKOFF_CAP_S) -> OutageRetry:
    """Retry on ConnectionError/TimeoutError with capped, jittered exponential backoff for
    `outage_s` seconds (default: outage_window()), reporting to `health`; `retries` >= 0 also
    caps the number of retries."""
    window = outage_window() if outage_s is None else outage_s
    if health is PROCESS_HEALTH:
        health = HEALTH if retries < 0 else None
    return OutageRetry(window_s=window, target=target, health=health, retries=retries, cap_s=backoff_cap_s)


def make_client(url: str, *, outage_s: float | None = None, retries: int = -1,
                socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S, connect_timeout: float = 5.0,
                health: Health | None = PROCESS_HEALTH, backoff_cap_s: float = BACKOFF_CAP_S) -> aioredis.Redis:
    """A client whose commands wait out an outage of up to `outage_s` (see retry_policy); replies
    are bytes (payloads are binary). A short-lived probe passes `retries` (and its own timeouts).

    TLS options (CA bundle, client certificate) go in the URL query, as redis-py reads them:
    `rediss://:PASSWORD@host:6380/0?ssl_ca_certs=/etc/redis-ca/ca.crt`.
    """
    endpoint = parse_endpoint(url)
    policy = retry_policy(outage_s=outage_s, retries=retries, health=health, backoff_cap_s=backoff_cap_s,
                          target=f"{endpoint.host}:{endpoint.port}/{endpoint.db}")
    return aioredis.Redis.from_url(
        url, retry=policy, socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout, socket_keepalive=True, health_check_interval=15,
        decode_responses=False)


async def connect(url: str, *, timeout: float = 10.0, outage_s: float | None = None, retries: int = -1,
                  socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S, health: Health | None = PROCESS_HEALTH,
                  backoff_cap_s: float = BACKOFF_CAP_S) -> aioredis.Redis:
    """Connect and PING until it answers or `timeout` passes; then return a client that rides out
    outages of up to `outage_s` (make_client).

    Raises RedisUnavailableError (host, port, TLS/password settings, attempts, last error) when
    Redis does not answer in time, and at once when it rejects the credentials or its certificate
    is not trusted.
    """
    endpoint = parse_endpoint(url)
    start = time.monotonic()
    deadline = start + timeout
    attempts, last = 0, "no attempt"
    while True:
        attempts += 1
        remaining = max(deadline - time.monotonic(), 0.05)
        probe = aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_timeout=remaining,
                                        socket_connect_timeout=remaining)
        try:
            await probe.ping()
            break
        except AuthenticationError as exc:
            raise RedisUnavailableError(
                f"Redis at {endpoint.host}:{endpoint.port} rejected the credentials "
                f"({endpoint.describe()}): {exc}") from exc
        except ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise RedisUnavailableError(
                    f"Redis at {endpoint.host}:{endpoint.port} requires other credentials "
                    f"({endpoint.describe()}): {exc}") from exc
            raise
        except (ConnectionError, TimeoutError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            if "CERTIFICATE_VERIFY_FAILED" in last:  # no retry makes an untrusted certificate trusted
                raise RedisUnavailableError(
                    f"Redis at {endpoint.host}:{endpoint.port} presented a certificate that is not "
                    f"trusted ({endpoint.describe()}); pass the CA as ?ssl_ca_certs=<path>: {last}") from exc
        finally:
            await probe.aclose()
        delay = backoff_delay(attempts, cap=backoff_cap_s)
        if time.monotonic() + delay > deadline:
            raise RedisUnavailableError(
                f"Redis unreachable at {endpoint.host}:{endpoint.port}: tried {endpoint.describe()} "
                f"{attempts} time(s) over {time.monotonic() - start:.1f}s with exponential backoff "
                f"(timeout {timeout}s); last error: {last}")
        await asyncio.sleep(delay)
    return make_client(url, outage_s=outage_s, retries=retries, socket_timeout=socket_timeout, health=health,
                       backoff_cap_s=backoff_cap_s)


async def wait_available(client: aioredis.Redis, timeout: float) -> bool:
    """PING until Redis answers or `timeout` passes; False if it did not.

    For a loop that wants to wait on its own terms (e.g. longer than the client's window after a
    command failed anyway). Each PING is bounded by what is left of `timeout`, since the client's
    own policy may retry longer than that."""
    deadline = time.monotonic() + timeout
    failures = 0
    while True:
        remaining = deadline - time.monotonic()
        try:
            await asyncio.wait_for(client.ping(), max(remaining, 0.01))
            return True
        except (ConnectionError, TimeoutError, OSError, asyncio.TimeoutError):
            failures += 1
            delay = backoff_delay(failures)
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that a reconnect can fix (as opposed to bugs or bad requests)."""
    return isinstance(exc, (ConnectionError, TimeoutError, OSError)) and not isinstance(exc, AuthenticationError)


__all__ = [
    "DEFAULT_OUTAGE_S",
    "ENV_REDIS_OUTAGE_S",
    "Endpoint",
    "OutageRetry",
    "RedisError",
    "RedisUnavailableError",
    "connect",
    "is_connection_error",
    "make_client",
    "outage_window",
    "parse_endpoint",
    "retry_policy",
    "set_outage_window",
    "wait_available",
]
