"""Waiting in async tests: poll a condition instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


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
