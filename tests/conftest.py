"""Shared fixtures (a real Redis server process per test) and the suite's three tiers.

Every test is in exactly one tier, a marker set here and counted at the end of each run
(`-m unit`, `-m integration` or `-m cluster` runs one):
- cluster: every test under tests/cluster/, and only those: against a real Kubernetes API, the
  control plane (with the test kubelet as its node) or a bare apiserver, with the real operator or
  kubectl (tests.support.control_plane, bare_apiserver, admission_gate, kube_cluster, cluster_e2e,
  operator_process, operator_jobs; a test elsewhere that uses them stops the run); those that
  start the built binaries are also marked `control_plane` (scripts/test.sh runs them once they are
  built);
- integration: real servers and processes without Kubernetes: a Redis server, the real model, the
  trainer or engine processes, a browser (the `slow`, `browser`, `vllm`, `sglang` markers or a Redis
  fixture);
- unit: the rest, pure functions and in-process objects.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from asyncrl.local.redis_server import LocalRedis

# Property tests draw the same examples on every run: a CI failure is then reproducible, never luck.
settings.register_profile("asyncrl", derandomize=True, print_blob=True)
settings.load_profile("asyncrl")

TIERS = ("unit", "integration", "cluster")
CLUSTER_SUPPORT = tuple(f"tests.support.{m}" for m in ("control_plane", "bare_apiserver", "admission_gate",
                                                       "kube_cluster", "cluster_e2e", "operator_process",
                                                       "operator_jobs"))
INTEGRATION_SUPPORT = tuple(f"tests.support.{m}" for m in ("trainer_support", "rollout_workers", "sglang_fake",
                                                           "sglang_fake_lora", "lora_models", "bench_support",
                                                           "reward_services", "tools"))
INTEGRATION_MARKERS = ("slow", "browser", "vllm", "sglang")
INTEGRATION_FIXTURES = {"redis_server", "redis_url", "transport_redis", "rollout_env"}
# A test this long (seconds) may have built a model: collect and trim after it (cheap beside it).
RELEASE_AFTER_S = 1.0


def _modules_used(func: object) -> set[str]:
    """The modules of the globals a function (and the functions nested in it) names."""
    code = getattr(func, "__code__", None)
    scope = getattr(func, "__globals__", {})
    found: set[str] = set()
    stack = [code] if code else []
    while stack:
        c = stack.pop()
        for value in (scope.get(name) for name in c.co_names):
            if value is not None:  # a class or function by its module, a module by its name
                found.add(getattr(value, "__module__", None) or getattr(value, "__name__", ""))
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    return found


CLUSTER_TESTS = Path(__file__).resolve().parent / "cluster"


def in_cluster_folder(item: pytest.Item) -> bool:
    return CLUSTER_TESTS in Path(str(item.path)).resolve().parents


def tier_of(item: pytest.Item) -> str:
    """The tier of a collected test (module docstring): its folder for tests/cluster/, else from its
    markers, its fixtures and what the test function and its fixtures call."""
    if in_cluster_folder(item):
        return "cluster"
    return tier_by_use(item)


def tier_by_use(item: pytest.Item) -> str:
    """The tier the test's markers, fixtures and calls say (cluster: it needs a Kubernetes API)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    used = _modules_used(getattr(item, "function", None))
    for name in fixtures:
        for fixture in defs.get(name, ()):
            used |= _modules_used(fixture.func)
    if item.get_closest_marker("cluster") or any(m.startswith(CLUSTER_SUPPORT) for m in used):
        return "cluster"
    if (any(item.get_closest_marker(m) for m in INTEGRATION_MARKERS) or fixtures & INTEGRATION_FIXTURES
            or any(m.startswith(INTEGRATION_SUPPORT) for m in used)):
        return "integration"
    return "unit"


CONTROL_PLANE_FIXTURES = {("tests.support.control_plane", "control_plane"), ("tests.support.bare_apiserver", "api")}
"""(module, name) of the fixtures that start the built Kubernetes binaries."""


def needs_control_plane(item: pytest.Item) -> bool:
    """Whether the test uses (directly or through another fixture) one of CONTROL_PLANE_FIXTURES."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any((fixture.func.__module__, name) in CONTROL_PLANE_FIXTURES
               for name in getattr(item, "fixturenames", ()) for fixture in defs.get(name, ()))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, one torch thread per worker and per child process: two workers with two
    threads each on two cores oversubscribe them (a packed train step took 237 s instead of 55 s)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """After a long test, hand its memory back: in-process Trainers (model, AdamW state, reference
    cycles) otherwise pile up until the next full collection, and freed heap pages stay with the
    process, so one pytest process grew past 11 GB and two xdist workers met the OOM killer."""
    start = time.monotonic()
    yield
    if time.monotonic() - start > RELEASE_AFTER_S:
        gc.collect()
        _malloc_trim()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier (and `control_plane` when it needs the built binaries), then put
    the heaviest files first: pytest-xdist hands out whole files in this order (`--dist loadfile
    --no-loadscope-reorder` in scripts/test.sh), so a file of a few long tests started last would
    keep one worker busy while the other idles."""
    weight: dict[str, int] = {}
    misplaced = sorted({item.nodeid.split("::", 1)[0] for item in items
                        if not in_cluster_folder(item) and tier_by_use(item) == "cluster"})
    if misplaced:
        raise pytest.UsageError("tests against a Kubernetes API belong under tests/cluster/: " + ", ".join(misplaced))
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
        if needs_control_plane(item):
            item.add_marker(pytest.mark.control_plane)
        file = item.nodeid.split("::", 1)[0]
        heaviness = _weight(item, tier)
        weight[file] = min(weight.get(file, heaviness), heaviness)
    items.sort(key=lambda item: weight[item.nodeid.split("::", 1)[0]])


def _weight(item: pytest.Item, tier: str) -> int:
    """0 runs first: cluster, then slow integration, other integration, unit."""
    if tier == "cluster":
        return 0
    if tier == "integration":
        return 1 if item.get_closest_marker("slow") else 2
    return 3


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how many tests of each tier passed, failed or were skipped."""
    counts = {tier: {} for tier in TIERS}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            keywords = getattr(report, "keywords", {})
            tier = next((t for t in TIERS if t in keywords), None)
            if tier and (report.when == "call" or outcome != "passed"):
                counts[tier][outcome] = counts[tier].get(outcome, 0) + 1
    line = "; ".join(f"{tier}: " + (", ".join(f"{n} {o}" for o, n in sorted(c.items())) or "none")
                     for tier, c in counts.items())
    terminalreporter.write_line(f"tiers: {line}")


REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = Path(os.environ.get("ASYNCRL_SHARED_DIR", REPO_ROOT.parent / "shared"))


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory the tests of one module share, removed once they are done. pytest keeps every
    tmp_path_factory directory until the session ends, and a module's trained weights and optimizer
    checkpoints are gigabytes: kept, they add up past the free disk of a CI machine."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A two-layer model of SmolLM2's architecture with the real tokenizer, as an HF directory
    (trainer_support.shared_tiny_model): for runs whose path is under test, not what the model learns;
    a step takes milliseconds where the embedded model's takes seconds and writes 0.5 GB of weights."""
    from tests.support.trainer_support import shared_tiny_model

    return shared_tiny_model()


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
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from tests.support.rollout_workers import JOB
    from tests.support.sglang_fake import FakeSGLang

    redis = await connect(redis_url)
    fake = FakeSGLang().start()
    yield redis, fake, StreamNames.for_job(JOB)
    fake.stop()
    await redis.aclose()
