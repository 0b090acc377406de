"""Shared fixtures: a real Redis server process per test (function scope) or per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from asyncrl.local_redis import LocalRedis

# Property tests draw the same examples on every run: a CI failure is then reproducible, never luck.
settings.register_profile("asyncrl", derandomize=True, print_blob=True)
settings.load_profile("asyncrl")

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


# --- transport (issue 4) fixtures -------------------------------------------------------------

@pytest.fixture
async def transport_redis(redis_url: str):
    """A retrying asyncio client (asyncrl.transport.connection.connect) on the test's server."""
    from asyncrl.transport.connection import connect

    client = await connect(redis_url, timeout=10)
    yield client
    await client.aclose()


@pytest.fixture
def make_trajectory_group():
    """Factory for small valid TrajectoryGroups: make(gid, n_samples=2, n_tokens=4, version=0)."""
    import numpy as np

    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    def make(gid: str, n_samples: int = 2, n_tokens: int = 4, version: int = 0, job: str = "job") -> TrajectoryGroup:
        samples = [TrajectorySample(i, np.arange(n_tokens, dtype=np.int32) + i,
                                    np.full(n_tokens, -0.5, dtype=np.float32),
                                    np.full(n_tokens, version, dtype=np.int32), float(i), "stop")
                   for i in range(n_samples)]
        return TrajectoryGroup(job, gid, f"prompt-{gid}", np.arange(3, dtype=np.int32), samples,
                               "engine-0", 1.0, 0.0)

    return make


@pytest.fixture
async def rollout_env(redis_url: str):
    """(a client of a real Redis, a fake SGLang server, the names of tests.support.rollout_workers.JOB)."""
    from asyncrl.transport.connection import connect
    from asyncrl.transport.names import StreamNames
    from tests.support.rollout_workers import JOB
    from tests.support.sglang_fake import FakeSGLang

    redis = await connect(redis_url)
    fake = FakeSGLang().start()
    yield redis, fake, StreamNames.for_job(JOB)
    fake.stop()
    await redis.aclose()
