"""Connection handling: clear errors at start, passwords, TLS (rediss://), riding out restarts."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest

from asyncrl.infra.net import free_port
from asyncrl.local.redis_server import LocalRedis
from asyncrl.transport.connection import RedisUnavailableError, connect, parse_endpoint


async def test_unreachable_redis_names_host_port_and_what_was_tried():
    port = free_port()  # nothing listens there
    with pytest.raises(RedisUnavailableError) as err:
        await connect(f"redis://:hunter2@127.0.0.1:{port}/0", timeout=0.5)
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "tried" in message and "TLS off" in message
    assert "password set" in message and "hunter2" not in message  # never leak the secret


def test_parse_endpoint():
    e = parse_endpoint("rediss://user:pw@redis.ns.svc:6380/2")
    assert (e.host, e.port, e.db, e.tls, e.has_password) == ("redis.ns.svc", 6380, 2, True, True)
    assert parse_endpoint("redis://localhost").port == 6379
    with pytest.raises(ValueError):
        parse_endpoint("http://localhost:6379")


def start_with_password(data_dir: Path, password: str) -> LocalRedis:
    """LocalRedis(password=...).start() hangs in its readiness probe (AUTH and PING replies can
    arrive in one recv), so set the password with CONFIG SET once the server is up."""
    import redis

    server = LocalRedis(data_dir).start()
    with redis.Redis(port=server.port) as plain:
        plain.config_set("requirepass", password)
    server.password = password
    return server


async def test_password_is_used_and_wrong_password_fails_fast(tmp_path: Path):
    server = start_with_password(tmp_path / "redis", "s3cret")
    try:
        client = await connect(server.url)
        assert await client.ping()
        await client.aclose()
        for url in (server.url.replace("s3cret", "wrong"), server.url.replace(":s3cret@", "")):
            with pytest.raises(RedisUnavailableError, match="credentials") as err:
                await connect(url, timeout=30)
            assert "wrong" not in str(err.value).replace("wrong password", "")
    finally:
        server.stop()


async def test_commands_retry_across_a_redis_restart(redis_server):
    client = await connect(redis_server.url)
    await client.set("k", "v1")
    redis_server.stop(kill=True)
    redis_server.start()
    await client.set("k", "v2")  # same client: reconnects with backoff
    assert await client.get("k") == b"v2"
    await client.aclose()


def _self_signed_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def _tls_proxy(cert: Path, key: Path, target_port: int) -> asyncio.AbstractServer:
    """TLS terminator in front of the plain server (the bundled Valkey is built without TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make a certificate")
async def test_rediss_tls_with_password(tmp_path: Path):
    cert, key = _self_signed_cert(tmp_path)
    server = start_with_password(tmp_path / "redis", "s3cret")
    proxy = await _tls_proxy(cert, key, server.port)
    port = proxy.sockets[0].getsockname()[1]
    try:
        url = f"rediss://:s3cret@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        client = await connect(url)
        await client.set("over-tls", "yes")
        assert await client.get("over-tls") == b"yes"
        await client.aclose()
        # TLS spoken to a plain-text port: a clear error, not a hang
        with pytest.raises(RedisUnavailableError, match="TLS on"):
            await connect(f"rediss://:s3cret@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}", timeout=0.5)
        # an untrusted certificate is refused at once, not retried (the timeout only bounds a loaded machine,
        # where the handshake, served by this test's own event loop, once took over 0.5 s)
        with pytest.raises(RedisUnavailableError, match=r"certificate that is not trusted.*CERTIFICATE_VERIFY_FAILED"):
            await connect(f"rediss://:s3cret@127.0.0.1:{port}/0", timeout=10)
    finally:
        proxy.close()
        await proxy.wait_closed()
        server.stop()


# --- riding out outages (issue 15, item 5) ----------------------------------------------------


def test_backoff_is_exponential_capped_and_jittered():
    """Each pause lies in the upper half of min(cap, base * 2^failures): it grows, never exceeds
    the cap (a Redis that is back is noticed within it), never drops to zero (no tight loop), and
    differs between clients (they do not reconnect in lockstep)."""
    import random

    from asyncrl.infra.health import backoff_delay

    rng = random.Random(0)
    for failures in range(1, 40):
        ceiling = min(2.0, 0.05 * 2 ** failures)
        for _ in range(20):
            assert ceiling / 2 <= backoff_delay(failures, base=0.05, cap=2.0, rng=rng) <= ceiling
    assert len({round(backoff_delay(8, rng=rng), 6) for _ in range(20)}) > 1


def test_the_outage_window_comes_from_the_flag_then_the_environment(monkeypatch):
    from asyncrl.transport.connection import (
        DEFAULT_OUTAGE_S,
        ENV_REDIS_OUTAGE_S,
        make_client,
        outage_window,
        set_outage_window,
    )

    monkeypatch.delenv(ENV_REDIS_OUTAGE_S, raising=False)
    assert outage_window() == DEFAULT_OUTAGE_S >= 120  # the issue asks for at least two minutes
    monkeypatch.setenv(ENV_REDIS_OUTAGE_S, "42")
    assert outage_window() == 42
    try:
        set_outage_window(7)
        assert outage_window() == 7
        assert make_client("redis://127.0.0.1:1/0").connection_pool.connection_kwargs["retry"].window_s == 7
    finally:
        set_outage_window(None)
    monkeypatch.setenv(ENV_REDIS_OUTAGE_S, "soon")
    with pytest.raises(ValueError, match=ENV_REDIS_OUTAGE_S):
        outage_window()
    with pytest.raises(ValueError):
        set_outage_window(-1)


def test_a_count_bounded_probe_reports_no_outage():
    """The operator's short reads of a job's Redis (retries=1) are not something its own process
    waits for: they must not make it look Degraded."""
    from asyncrl.infra.health import HEALTH
    from asyncrl.transport.connection import retry_policy

    assert retry_policy(retries=1).health is None
    assert retry_policy().health is HEALTH


def test_trainer_and_rollout_take_the_window_on_the_command_line():
    import argparse

    from asyncrl.rollout.main import configure as rollout_configure
    from asyncrl.trainer.main import configure as trainer_configure

    for configure, extra in ((trainer_configure, []), (rollout_configure, ["--engine-outage-s", "30"])):
        parser = argparse.ArgumentParser()
        configure(parser)
        args = parser.parse_args(["--config", "job.yaml", "--redis-outage-s", "240", *extra])
        assert args.redis_outage_s == 240
    assert args.engine_outage_s == 30


@pytest.mark.parametrize("retryable", [True, False], ids=["retryable", "not-retryable"])
async def test_a_cancelled_caller_is_not_retried_through_the_outage_window(retryable: bool) -> None:
    """A cancellation that the client library turns into a connection error (it closes the socket
    and raises) must still cancel the caller at once, not be retried for the whole window: a worker
    shutting down waited on such a retry (seen in CI: its version follower outlived the 60 s test)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from asyncrl.infra.health import Health
    from asyncrl.transport.connection import OutageRetry

    attempts = 0

    async def do() -> None:
        nonlocal attempts
        attempts += 1
        try:
            await asyncio.sleep(3600)  # a blocking read
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed while reading") from None

    async def fail(error: Exception) -> None:
        return None

    retry = OutageRetry(window_s=60.0, target="test", health=Health())
    # (redis-py asks is_retryable first: an error it calls final must not escape as one either)
    task = asyncio.create_task(retry.call_with_retry(do, fail, is_retryable=lambda error: retryable))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    assert task in done, "the cancelled call was retried instead of cancelled"
    assert task.cancelled() and attempts == 1
