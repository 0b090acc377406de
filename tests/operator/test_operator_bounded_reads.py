"""The operator's reads from a job's pods are bounded, and what it connects to is restricted: one job
cannot make the operator, shared by every tenant, hold an arbitrary reply, wait on it forever, or
connect wherever and however the job's Secret says. Against real sockets (a hostile status server
in this process) and a real Redis server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from asyncrl.api.outcome import new_outcome, write_outcome_redis
from asyncrl.api.status_report import TrainerReport
from asyncrl.api.stream_names import StreamNames
from asyncrl.operator.mirror import (
    MAX_OUTCOME_BYTES,
    MAX_REPORT_BYTES,
    MirrorError,
    OutcomeReader,
    RedisSettings,
    external_redis_url,
    fetch_report,
)
from asyncrl.transport.connection import connect

CHUNK = b"x" * 65536


@dataclass
class Sent:
    """What the hostile server wrote before the operator hung up, and whether it got to the end."""

    body: int = 0
    finished: bool = False


Reply = Callable[[asyncio.StreamWriter, Sent], Awaitable[None]]


@asynccontextmanager
async def status_server(reply: Reply) -> AsyncIterator[tuple[str, Sent]]:
    sent = Sent()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await reply(writer, sent)
            sent.finished = True
        except (ConnectionError, OSError):
            pass  # the operator hung up: what it did not read was never sent
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", sent
    finally:
        server.close()


async def endless_chunks(writer: asyncio.StreamWriter, sent: Sent) -> None:
    """128 MiB of chunked body that never says how long it is (the reply of the security review)."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(128 * 1024 * 1024 // len(CHUNK)):
        writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        await writer.drain()
        sent.body += len(CHUNK)
    writer.write(b"0\r\n\r\n")


async def announced_huge(writer: asyncio.StreamWriter, sent: Sent) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (1024 * 1024 * 1024))
    for _ in range(1024):
        writer.write(CHUNK)
        await writer.drain()
        sent.body += len(CHUNK)


async def slow_drip(writer: asyncio.StreamWriter, sent: Sent) -> None:
    """A valid report, one byte every 0.1 s: each read comes in time, the whole never does (600 s)."""
    body = TrainerReport(job="drip", message="." * 6000).model_dump_json().encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i in range(len(body)):
        writer.write(body[i:i + 1])
        await writer.drain()
        sent.body += 1
        await asyncio.sleep(0.1)


async def small_report(writer: asyncio.StreamWriter, sent: Sent) -> None:
    body = TrainerReport(job="fine", step=7).model_dump_json().encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    sent.body += len(body)


async def test_an_oversized_report_is_refused_after_the_limit_not_read_to_the_end():
    async with status_server(endless_chunks) as (url, sent):
        with pytest.raises(MirrorError, match=f"sent over {MAX_REPORT_BYTES} bytes"):
            await fetch_report(url, timeout=60)
    assert not sent.finished and sent.body < 32 * 1024 * 1024, "the operator stopped reading at the limit"


async def test_an_announced_oversized_report_is_refused_before_its_body():
    async with status_server(announced_huge) as (url, sent):
        with pytest.raises(MirrorError, match=f"announced {1024 ** 3} bytes, over the operator's limit"):
            await fetch_report(url, timeout=60)
    assert not sent.finished


async def test_a_slow_drip_ends_at_the_deadline_not_when_the_server_stops():
    async with status_server(slow_drip) as (url, sent):
        with pytest.raises(MirrorError, match="did not complete within its 1s deadline"):
            await fetch_report(url, timeout=1.0)
    assert not sent.finished and sent.body > 0, "the drip was still going when the operator gave up"


async def test_a_report_within_the_limits_is_read():
    async with status_server(small_report) as (url, _):
        report = await fetch_report(url, timeout=5)
    assert (report.job, report.step) == ("fine", 7)


async def test_an_oversized_outcome_record_is_refused_and_a_real_one_read(redis_url):
    names = StreamNames.for_job("big", "uid-1")
    client = await connect(redis_url)
    reader = OutcomeReader(RedisSettings(timeout=2.0))
    try:
        await client.set(names.outcome, b"{" + b" " * (MAX_OUTCOME_BYTES * 4))
        with pytest.raises(MirrorError, match=f"over {MAX_OUTCOME_BYTES} bytes, the operator's limit"):
            await reader.read("k", redis_url, names, "uid-1")
        await client.delete(names.outcome)
        assert await reader.read("k", redis_url, names, "uid-1") is None, "no record yet"
        assert await write_outcome_redis(client, names, new_outcome("big", "uid-1", "Succeeded", "MaxStepsReached"))
        got = await reader.read("k", redis_url, names, "uid-1")
        assert got is not None and got.reason == "MaxStepsReached"
    finally:
        await reader.close()
        await client.aclose()


def test_an_external_redis_url_is_used_without_its_options_and_only_where_allowed():
    url = "rediss://user:p%40ss@redis.team-a.example.com:6380/2?ssl_ca_certs=/etc/passwd&socket_timeout=999"
    assert external_redis_url(url) == "rediss://user:p%40ss@redis.team-a.example.com:6380/2"
    assert external_redis_url("redis://:pw@10.0.0.7") == "redis://:pw@10.0.0.7:6379"
    assert external_redis_url(url, ("*.team-a.example.com", "10.*")) == "rediss://user:p%40ss@redis.team-a.example.com:6380/2"
    with pytest.raises(MirrorError, match=r"host redis.team-a.example.com is not one this operator may reach "
                                          r"\(--external-redis-hosts \*.team-b.example.com\)") as refused:
        external_redis_url(url, ("*.team-b.example.com",))
    assert "p%40ss" not in str(refused.value) and "p@ss" not in str(refused.value)
    for bad, why in (("unix:///var/run/operator.sock", "must start with redis:// or rediss://, got unix://"),
                     ("http://redis:6379", "got http://"), ("redis://:pw@/0", "names no host"),
                     ("redis://redis:99999/0", "bad port for host redis")):
        with pytest.raises(MirrorError, match=why):
            external_redis_url(bad)
