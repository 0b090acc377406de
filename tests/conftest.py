"""Shared fixtures: a real Redis server process per test (function scope) or per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.local_redis import LocalRedis

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = Path(os.environ.get("ASYNCRL_SHARED_DIR", REPO_ROOT.parent / "shared"))


@pytest.fixture
def redis_server(tmp_path: Path):
    """A fresh real Redis-compatible server (AOF on) for one test; `.url`, `.stop()`, `.start()`."""
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url
