"""Probe workers: exec, httpGet and tcpSocket probes run as kubelet runs them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp

from tests.support.kube_cluster.api import Clock
from tests.support.kube_cluster.objects import LOCAL_IP, Obj


async def http_probe(session: aiohttp.ClientSession, port: int, action: Obj, timeout: float) -> bool:
    scheme = (action.get("scheme") or "HTTP").lower()
    host = action.get("host") or LOCAL_IP
    path = action.get("path") or "/"
    headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
    try:
        async with session.get(f"{scheme}://{host}:{port}{path}", headers=headers, allow_redirects=False,
                               ssl=False, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return 200 <= resp.status < 400
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def tcp_probe(port: int, host: str | None, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host or LOCAL_IP, port), timeout)
    except (asyncio.TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class ProbeWorker:
    """One probe of one container instance on kubelet's schedule: wait `initialDelaySeconds`, then probe every
    `periodSeconds` with `timeoutSeconds`; report when `successThreshold` successes or `failureThreshold`
    failures in a row are reached (once per streak); `report` returns True to end the worker."""

    def __init__(self, kind: str, spec: Obj, check: Callable[[float], Awaitable[bool]], clock: Clock,
                 report: Callable[[str, bool], bool]):
        self.kind, self.check, self.clock, self.report = kind, check, clock, report
        self.initial_delay = float(spec.get("initialDelaySeconds", 0))
        self.period = float(spec.get("periodSeconds", 10))
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.last: bool | None = None
        self.stopped = False  # besides cancel(): Python 3.11's wait_for can swallow a cancellation

    async def run(self) -> None:
        await asyncio.sleep(self.clock.seconds(self.initial_delay))
        successes = failures = 0
        while not self.stopped:
            try:
                ok = await asyncio.wait_for(self.check(self.clock.timeout(self.timeout)),
                                            self.clock.timeout(self.timeout) + 1.0)
            except (asyncio.TimeoutError, RuntimeError, OSError):  # RuntimeError: the cluster is shutting down
                ok = False
            if self.stopped:
                return
            self.last = ok
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if successes == self.success_threshold and self.report(self.kind, True):
                return
            if failures == self.failure_threshold and self.report(self.kind, False):
                return
            await asyncio.sleep(self.clock.seconds(self.period))
