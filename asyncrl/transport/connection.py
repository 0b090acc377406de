"""Connect to Redis (redis:// or rediss:// with a password) and survive its restarts.

Why: rollout pods and the trainer outlive Redis restarts. Every command is retried on connection
and timeout errors with capped exponential backoff (redis-py's own Retry does that; we only
choose the policy). At start-up, an unreachable Redis fails with RedisUnavailableError naming
the host, port and what was tried, instead of a bare socket error deep inside a worker loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError, TimeoutError

from asyncrl.errors import TransportError

DEFAULT_RETRIES = 10
"""Per-command retries. With base 0.05 s and a 2 s cap this rides out about 10 s of outage."""
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
DEFAULT_SOCKET_TIMEOUT_S = 30.0
"""Must exceed the longest BLOCK we issue (reads block at most a few seconds)."""


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


def retry_policy(retries: int = DEFAULT_RETRIES) -> Retry:
    """Retry on ConnectionError/TimeoutError with capped, jittered exponential backoff."""
    return Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)


def make_client(url: str, *, retries: int = DEFAULT_RETRIES, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S,
                connect_timeout: float = 5.0) -> aioredis.Redis:
    """A client that reconnects with backoff; replies are bytes (payloads are binary).

    TLS options (CA bundle, client certificate) go in the URL query, as redis-py reads them:
    `rediss://:PASSWORD@host:6380/0?ssl_ca_certs=/etc/redis-ca/ca.crt`.
    """
    parse_endpoint(url)
    return aioredis.Redis.from_url(
        url, retry=retry_policy(retries), socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout, socket_keepalive=True, health_check_interval=15,
        decode_responses=False)


async def connect(url: str, *, timeout: float = 10.0, retries: int = DEFAULT_RETRIES,
                  socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """Connect and PING until it answers or `timeout` passes; then return a retrying client.

    Raises RedisUnavailableError (host, port, TLS/password settings, attempts, last error) when
    Redis does not answer in time, and at once when it rejects the credentials.
    """
    endpoint = parse_endpoint(url)
    start = time.monotonic()
    deadline = start + timeout
    attempts, delay, last = 0, BACKOFF_BASE_S, "no attempt"
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
        finally:
            await probe.aclose()
        if time.monotonic() + delay > deadline:
            raise RedisUnavailableError(
                f"Redis unreachable at {endpoint.host}:{endpoint.port}: tried {endpoint.describe()} "
                f"{attempts} time(s) over {time.monotonic() - start:.1f}s with exponential backoff "
                f"(timeout {timeout}s); last error: {last}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, BACKOFF_CAP_S)
    return make_client(url, retries=retries, socket_timeout=socket_timeout)


async def wait_available(client: aioredis.Redis, timeout: float) -> bool:
    """PING until Redis answers or `timeout` passes (for loops that outlived a long outage)."""
    deadline = time.monotonic() + timeout
    delay = BACKOFF_BASE_S
    while True:
        try:
            await client.ping()
            return True
        except (ConnectionError, TimeoutError, OSError):
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_CAP_S)


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that a reconnect can fix (as opposed to bugs or bad requests)."""
    return isinstance(exc, (ConnectionError, TimeoutError, OSError)) and not isinstance(exc, AuthenticationError)


__all__ = [
    "Endpoint",
    "RedisError",
    "RedisUnavailableError",
    "connect",
    "is_connection_error",
    "make_client",
    "parse_endpoint",
    "retry_policy",
    "wait_available",
]
