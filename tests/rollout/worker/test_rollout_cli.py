"""`asyncrl rollout` as a process: publishes groups from a job file, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.transport.versions import EngineRegistry
from tests.support.sglang_fake import FakeSGLang

pytestmark = pytest.mark.slow

JOB_YAML = """
apiVersion: asyncrl.dev/v1alpha1
kind: AsyncRLJob
metadata:
  name: cli-rollout
spec:
  model:
    path: embedded:SmolLM2-135M-Instruct
  dataset:
    source: builtin:arithmetic
  reward:
    function: exact-number
  algorithm:
    groupSize: 2
    batchSize: 2
    maxNewTokens: 4
  staleness:
    maxHeadOffpolicyness: 1
  rollout:
    engine: sglang
    maxConcurrentRequests: 4
"""


async def test_rollout_command_publishes_and_stops_on_sigterm(redis_url, tmp_path: Path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML)
    fake = FakeSGLang(token_delay=0.01).start()
    redis = await connect(redis_url)
    names = StreamNames.for_job("cli-rollout")
    env = dict(os.environ, ASYNCRL_REDIS_URL=redis_url, ASYNCRL_ENGINE_URL=fake.url, ASYNCRL_POD_NAME="rollout-0")
    log = (tmp_path / "rollout.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout", "--config", str(job), "--log-every", "1"],
                            cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        # B=2, eta=1 at version 0: (1 + 0 + 1) * 2 = 4 groups may be accepted, then the worker blocks
        while await redis.xlen(names.trajectories) < 4:
            assert proc.poll() is None, (tmp_path / "rollout.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "rollout.log").read_text()
            time.sleep(0.05)
        [info] = await EngineRegistry(redis, names).list()
        assert info.engine_id == "rollout-0" and info.url == fake.url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "rollout.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        fake.stop()
    snap = await Admission(redis, names, batch_size=2, staleness=StalenessPolicy.global_budget(1),
                           max_concurrent=4).snapshot()
    assert snap.running == 0 and snap.accepted == 4
    assert await EngineRegistry(redis, names).list() == []
    assert "rollout worker stopped" in (tmp_path / "rollout.log").read_text()
    await redis.aclose()


async def test_waiting_for_a_dependency_says_which_and_gives_up_with_its_name(caplog, monkeypatch):
    """A worker held by its engine or reward service names it in its log while it waits, and in the
    error when it gives up (a silent wait looked like a hung worker)."""
    from asyncrl.rollout.worker import process as W

    monkeypatch.setattr(W.asyncio, "sleep", _no_sleep)
    answers = iter([False, False, True])

    async def ready() -> bool:
        return next(answers)

    caplog.set_level("INFO", logger="asyncrl.rollout")
    await W.wait_until_ready(ready, "reward service http://reward:8100", timeout=60)
    said = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(said) == 1 and "reward service http://reward:8100" in said[0], said

    async def never() -> bool:
        return False

    with pytest.raises(W.StartupError, match="reward service http://reward:8100 not ready after 0s"):
        await W.wait_until_ready(never, "reward service http://reward:8100", timeout=0)


async def _no_sleep(_seconds: float) -> None:
    return None
