"""Forced staleness (spec.trainer.weightSyncLag, issue 20): the real trainer publishing to a fake
SGLang engine registered in a real Redis tells it to load version v - lag, keeps that version's
weights on disk, catches a restarted engine up to it too, and the batches generated on it (tagged
with the version the engine serves, as a rollout worker tags them) are trained at least `lag`
versions stale; the policy version stays the trainer's. Lag 0 is the old behaviour."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from asyncrl.trainer.weights.files import published_versions, retained_versions, served_version
from asyncrl.transport.versions import EngineInfo, VersionChannel
from tests.support.jobs import JobBuilder
from tests.support.sglang_fake import FakeSGLang
from tests.support.trainer_support import make_groups, model_and_tokenizer, tiny_model

STEPS = 4


async def _lagged_run(tmp_path: Path, redis_url: str, lag: int, fake: FakeSGLang) -> dict[str, Any]:
    """STEPS trainer steps; before each, the "rollout" makes a batch on the version the engine serves."""
    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

    job = JobBuilder.small(name=f"lag{lag}", batch_size=2, eta=2, max_steps=STEPS, trainer={"weightSyncLag": lag}).job()
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c",
                      run_dir=tmp_path, pod_name="trainer-0")
    io = await connect_io(job, runtime)
    names = io.admission.names
    try:
        await TrajectoryConsumer(io.redis, names, "setup").ensure_group()
        producer = TrajectoryProducer(io.redis, names)
        await io.registry.register(EngineInfo("pod-0", fake.url, 0, True, time.time(), incarnation="i0"))
        _, tok = model_and_tokenizer()
        model = tiny_model()
        cfg = RunConfig(engine_kind="sglang", weights_dir=runtime.weights_dir,
                        checkpoint_dir=runtime.checkpoint_dir, weight_sync_timeout_s=10, read_block_ms=50,
                        engine_max_age_s=3600)  # (no worker heartbeats here: steps on CPU are slow)
        trainer = Trainer(job, cfg, DistContext(), model, torch.optim.AdamW(model.parameters()), tok, io=io)
        await trainer.settle_restored()
        await trainer.startup_sync()
        served, lags, dirs, record = [], [], [], {}
        for step in range(STEPS):
            engine_version = (await io.registry.list(max_age_s=3600))[0].weight_version
            assert engine_version is not None
            served.append(engine_version)
            for group in make_groups(job.metadata.name, 2, version=engine_version, prefix=f"s{step}-", seed=step):
                await producer.publish(group)
            groups = await trainer.next_batch()
            assert groups is not None and len(groups) == 2
            record = trainer.train_step(groups)
            await trainer.publish_next()
            trainer.finish_step(groups, record)
            lags.append(sorted(int(k) for k in record.staleness_histogram))
            dirs.append(published_versions(runtime.weights_dir))
        latest = await VersionChannel(io.redis, names).latest()
        updates = [c for c in fake.state.control_calls if c.startswith("update")]
        fake.restart()  # a restarted server on its launch weights: catch-up must load the lagged version
        await io.registry.register(EngineInfo("pod-0", fake.url, None, True, time.time() + 1, incarnation="i1"))
        await trainer.refresh_engines()
        after_restart = (await io.registry.list(max_age_s=3600))[0].weight_version
        return {"served": served, "lags": lags, "dirs": dirs, "trainer": trainer, "latest": latest, "record": record,
                "after_restart": after_restart, "updates": updates,
                "restart_updates": [c for c in fake.state.control_calls if c.startswith("update")]}
    finally:
        await io.redis.aclose()


@pytest.fixture
def fake():
    server = FakeSGLang().start()
    yield server
    server.kill()


@pytest.mark.slow
def test_lag_2_engines_load_v_minus_2_and_batches_are_at_least_2_stale(tmp_path: Path, redis_url: str, fake):
    """Before: no weightSyncLag (the spec refused it) and the engines always loaded the newest version."""
    out = asyncio.run(_lagged_run(tmp_path, redis_url, 2, fake))
    # before step s the trainer is at version s and the engine serves max(s - 2, 0)
    assert out["served"] == [0, 0, 0, 1]
    # publish v1, v2: the engine already serves the base model v0 (no directory): nothing to load;
    # v3 and v4 load v1 and v2
    assert out["updates"] == ["update:1", "update:2"]
    # a batch trained at version v >= 2 was generated on v - 2: every token is exactly 2 versions old
    assert out["lags"] == [[0], [1], [2], [2]]
    # weights v - 2 .. v stay on disk after each publish (v2 was pruned only once v5 would need it)
    assert out["dirs"] == [[1], [1, 2], [1, 2, 3], [2, 3, 4]]
    trainer = out["trainer"]
    report = trainer.get_report()
    assert trainer.state.version == STEPS and report.policy_version == STEPS  # the trainer's, not the lagged one
    assert out["latest"] is not None and out["latest"].version == STEPS
    assert report.staleness.histogram.get("2", 0) > 0
    assert out["after_restart"] == 2 and out["restart_updates"] == ["update:2"]  # caught up to v4 - 2


@pytest.mark.slow
def test_lag_0_is_unchanged(tmp_path: Path, redis_url: str, fake):
    out = asyncio.run(_lagged_run(tmp_path, redis_url, 0, fake))
    report, record = out["trainer"].get_report(), out["record"]  # the loss-shape figures reach /status
    assert report.last_step is not None
    for key in ("clip_fraction_low", "clip_fraction_high", "bapo_clip_low", "bapo_clip_high"):
        assert getattr(report.last_step, key) == pytest.approx(getattr(record, key)), key
    assert report.last_step.bapo_clip_high == 0.0  # (BAPO off)
    assert out["served"] == [0, 1, 2, 3]
    assert out["updates"] == ["update:1", "update:2", "update:3", "update:4"]
    assert out["lags"] == [[0], [0], [0], [0]]
    assert out["dirs"] == [[1], [1, 2], [2, 3], [3, 4]]
    assert out["after_restart"] == 4 and out["restart_updates"] == ["update:4"]


def test_served_and_retained_versions():
    assert [served_version(v, 2) for v in range(5)] == [0, 0, 0, 1, 2]
    assert [served_version(v, 0) for v in range(3)] == [0, 1, 2]
    assert retained_versions(5, 0) == {4, 5} and retained_versions(5, 1) == {4, 5}
    assert retained_versions(5, 3) == {2, 3, 4, 5} and retained_versions(1, 3) == {0, 1}


@pytest.mark.parametrize("staleness, lag, ok", [
    ({"maxHeadOffpolicyness": 2}, 2, True),
    ({"maxHeadOffpolicyness": 2}, 3, False),
    ({"maxHeadOffpolicyness": 0}, 1, False),
    ({"policy": "per-sample", "asyncRatio": 1.5}, 2, True),
    ({"policy": "per-sample", "asyncRatio": 1.5}, 3, False),
    ({"policy": "per-sample", "asyncRatio": 0.0}, 0, True),
])
def test_the_lag_must_be_within_the_staleness_bound(staleness, lag, ok):
    from asyncrl.api.spec import AsyncRLJob

    doc = JobBuilder.small(trainer={"weightSyncLag": lag}).doc()
    doc["spec"]["staleness"] = staleness
    if ok:
        assert AsyncRLJob.model_validate(doc).spec.trainer.weight_sync_lag == lag
    else:
        with pytest.raises(ValidationError, match=r"trainer.weightSyncLag .* exceeds the staleness bound"):
            AsyncRLJob.model_validate(doc)


def test_a_negative_lag_is_rejected():
    with pytest.raises(ValidationError, match="weightSyncLag"):
        JobBuilder.small(trainer={"weightSyncLag": -1}).job()
