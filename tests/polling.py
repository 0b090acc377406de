"""Waiting in tests: poll a condition instead of sleeping for a guessed time (async and sync)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def poll(cond: Callable[[], Awaitable[Any]], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.01) -> Any:
    """Await `cond()` until it returns something truthy and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
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
