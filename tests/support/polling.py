"""Waiting in tests: poll a condition instead of sleeping for a guessed time (the one helper, for
async tests and, as `poll_sync`, for code that is not async)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


async def poll(cond: Callable[[], Awaitable[Any] | Any], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.01, *, log: Path | None = None, describe: Callable[[], str] | None = None) -> Any:
    """Call `cond()` (sync or async) until it returns something truthy and return that; after
    `timeout` s fail, saying what was awaited, the last value, and the tail of `log` and/or
    `describe()` (a process's log, a cluster's state)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            tail += describe() if describe is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})\n{tail}")
        await asyncio.sleep(interval)


def poll_sync(cond: Callable[[], T | None], timeout: float = 60.0, what: str = "condition",
              interval: float = 0.2) -> T:
    """`poll` for code that is not async (e.g. a real control plane's controllers acting)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(interval)
