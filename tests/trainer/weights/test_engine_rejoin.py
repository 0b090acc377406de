"""Engines rejoin on the current weights (issue 15, item 4), against the fake SGLang server (which
comes back from a restart labelled "default" on its launch weights, as the pin does) and a real
Redis server: a restarted engine is not used until the trainer reloaded it; the registry never
names a version nobody can know; not-ready engines are left out of pushes; a failing engine is
fenced, retried by catch-up and unfenced; a group its engine interrupted is generated again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.api.weight_labels import WeightLabel
from asyncrl.rollout.data.datasets import ArithmeticSource
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.trainer.weights import engine_update as weight_sync
from asyncrl.trainer.weights.engine_update import WeightSyncError, catch_up, update_engines
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.transport.versions import EngineInfo, EngineRegistry, VersionChannel, VersionEvent
from asyncrl.transport.wire import decode_group
from tests.support.jobs import JobBuilder
from tests.support.polling import poll
from tests.support.sglang_fake import FakeSGLang, fake_logprob

JOB = "rejoin"


@pytest.fixture
async def env(redis_url):
    redis = await connect(redis_url)
    fakes: list[FakeSGLang] = []
    yield redis, StreamNames.for_job(JOB), fakes
    for fake in fakes:  # (killed: a modelled hung update would hold a graceful stop)
        fake.kill()
    await redis.aclose()


def make_worker(redis, names, fake, *, eta: int, max_groups=None, outage_s=180.0, max_new=8) -> RolloutWorker:
    cfg = WorkerConfig(job=JOB, engine_id="pod-0", group_size=2, engine_url=fake.url,
                       sampling=SamplingParams(max_new_tokens=max_new), max_concurrent_requests=4, backoff_s=0.01,
                       backoff_max_s=0.05, engine_outage_s=outage_s, heartbeat_s=0.1, log_every_s=60,
                       max_groups=max_groups)
    admission = Admission(redis, names, batch_size=100, staleness=StalenessPolicy.global_budget(eta), max_concurrent=8,
                          lease_seconds=30)
    prompts = Mixture.single(ArithmeticSource(seed=0, difficulty=1),
                             lambda item: [ord(c) % 200 + 3 for c in item.question],
                             RewardScorer(exact_number_reward, 5.0))
    return RolloutWorker(cfg, engine=SGLangEngine(fake.url), redis=redis, prompts=prompts,
                         decode=lambda ids: " ".join(map(str, ids)), admission=admission, names=names)


async def publish(redis, names, registry, fake_url_or_info, path: Path, version: int) -> None:
    """What the trainer does after a step: the event, then the push."""
    path.mkdir(exist_ok=True)
    await VersionChannel(redis, names).publish(VersionEvent(version=version, weights_path=str(path), time=time.time()))
    await update_engines("sglang", await registry.list(), path, version, registry=registry, timeout_s=10)


async def test_a_restarted_engine_is_not_used_until_the_trainer_reloads_it(env, tmp_path: Path):
    """Before: the worker went on generating on the restarted server's base weights at once."""
    redis, names, fakes = env
    fake = FakeSGLang(token_delay=0.002).start()
    fakes.append(fake)
    registry = EngineRegistry(redis, names)
    worker = make_worker(redis, names, fake, eta=0)
    run = asyncio.create_task(worker.run())
    await poll(lambda: _registered(registry), what="the engine registered")
    await publish(redis, names, registry, fake.url, tmp_path / "v1", 1)
    await poll(lambda: _version_seen(worker, 1), what="the worker on v1")
    first = (await registry.list())[0]
    assert (first.label, first.weight_version) == ("1", 1)

    fake.restart()  # a new server process: launch weights, labelled "default"
    await poll(lambda: _label(registry, "default"), what="the restart registered")
    after = (await registry.list())[0]
    assert after.incarnation != first.incarnation and after.weight_version == 0
    await poll(lambda: _true(worker.stats.weight_waits >= 1), what="the worker waiting")
    assert fake.state.generate_calls == []  # nothing generated on base weights at policy v1, eta 0
    assert worker.health.is_failing("engine-weights", fake.url)

    assert await catch_up("sglang", registry, tmp_path / "v1", 1, timeout_s=10) == [fake.url]
    assert fake.state.control_calls == ["pause:abort", "update:1", "continue"]
    await poll(lambda: _true(len(fake.state.generate_calls) >= 4), what="generation on the reloaded engine")
    worker.stop()
    await asyncio.wait_for(run, 30)
    assert not worker.health.is_failing("engine-weights", fake.url)
    for _, fields in await redis.xrange(names.trajectories):
        for sample in decode_group(fields[b"data"]).samples:
            for v, lp in zip(sample.versions, sample.behav_logprobs):
                # the fake's logprob says which weights made a token: -0.01 * (i + 1) - version
                assert v in (0, 1) and (lp <= fake_logprob(0, "1") + 1e-6) == (v == 1)


async def test_the_registry_never_names_the_version_of_a_restarted_engine(env):
    """The trainer's record describes the incarnation it loaded into, not the next one."""
    redis, names, _ = env
    registry = EngineRegistry(redis, names)
    now = time.time()
    await registry.register(EngineInfo("e", "http://e", None, True, now, incarnation="a"))
    await registry.begin_update("e", 4, timeout_s=10)
    await registry.end_update("e", loaded=True, incarnation="a")
    assert [e.weight_version for e in await registry.list()] == [4]
    await registry.register(EngineInfo("e", "http://e", None, True, time.time() + 1, incarnation="b"))
    assert [e.weight_version for e in await registry.list()] == [None]
    rec = await registry.weights("e")
    assert rec is not None and rec.label_for("a") == WeightLabel(4) and rec.label_for("b") is None


async def test_catch_up_reloads_an_engine_whose_version_is_unknown(env, tmp_path: Path):
    """Before: catch_up left engines whose version is unknown alone."""
    redis, names, fakes = env
    fake = FakeSGLang().start()
    fakes.append(fake)
    registry = EngineRegistry(redis, names)
    await registry.register(EngineInfo("e", fake.url, None, True, time.time(), incarnation="x"))
    (tmp_path / "v2").mkdir()
    assert await catch_up("sglang", registry, tmp_path / "v2", 2, timeout_s=10) == [fake.url]
    assert fake.state.control_calls == ["pause:abort", "update:2", "continue"]
    assert [e.weight_version for e in await registry.list()] == [2]


async def test_pushes_skip_not_ready_engines_and_fence_a_failing_one(env, tmp_path: Path, monkeypatch):
    """Before: not-ready engines were pushed to, and a failing engine failed every push."""
    redis, names, fakes = env
    good, slow, starting = (FakeSGLang().start() for _ in range(3))
    fakes += [good, slow, starting]
    registry = EngineRegistry(redis, names)
    now = time.time()
    for i, (fake, ready) in enumerate([(good, True), (slow, True), (starting, False)]):
        await registry.register(EngineInfo(f"e{i}", fake.url, 0, ready, now, incarnation=f"i{i}"))
    slow.state.update_delay = 2.0  # its load does not finish within the push's timeout
    monkeypatch.setattr(weight_sync, "FENCE_BACKOFF_S", 0.0)
    (tmp_path / "v1").mkdir()
    with pytest.raises(WeightSyncError) as err:
        await update_engines("sglang", await registry.list(), tmp_path / "v1", 1, registry=registry, timeout_s=0.5)
    assert list(err.value.failures) == [slow.url] and err.value.fenced == ["e1"] and err.value.updated == 1
    assert starting.state.control_calls == []
    by_id = {e.engine_id: e for e in await registry.list()}
    assert by_id["e1"].fenced and not by_id["e0"].fenced and by_id["e0"].weight_version == 1

    (tmp_path / "v2").mkdir()  # the next push leaves the fenced engine out and succeeds
    result = await update_engines("sglang", await registry.list(), tmp_path / "v2", 2, registry=registry,
                                  timeout_s=5)
    assert result.engines == 1 and sorted(result.skipped) == sorted([slow.url, starting.url])
    assert "update:2" not in slow.state.control_calls

    slow.state.update_delay = 0.0  # catch-up retries it (its backoff is over) and unfences it
    assert await catch_up("sglang", registry, tmp_path / "v2", 2, timeout_s=5) == [slow.url]
    by_id = {e.engine_id: e for e in await registry.list()}
    assert by_id["e1"].fenced == "" and by_id["e1"].weight_version == 2
    assert starting.state.control_calls == []  # not ready: still left alone


async def test_a_group_its_engine_interrupted_is_generated_again(env):
    """Before: a group whose engine stayed away past engine_outage_s was dropped and its prompt
    marked done: the prompt was never answered."""
    redis, names, fakes = env
    fake = FakeSGLang(token_delay=0.05).start()
    fakes.append(fake)
    worker = make_worker(redis, names, fake, eta=5, max_groups=3, outage_s=0.3, max_new=10)
    run = asyncio.create_task(worker.run())
    await poll(lambda: _true(fake.state.tokens_generated >= 2), what="generation")
    fake.kill()  # the answers in flight never come
    await poll(lambda: _true(worker.stats.requeued >= 1), what="an interrupted group")
    fake.restart()
    stats = await asyncio.wait_for(run, 60)
    prompts = sorted(decode_group(f[b"data"]).prompt_id for _, f in await redis.xrange(names.trajectories))
    assert prompts == [f"arith-0-1-{i}" for i in range(3)]
    assert stats.groups_dropped == 0 and stats.groups_published == 3
    snap = await worker.admission.snapshot()  # counted job-wide, with why (what a stalled job quotes)
    assert snap.engine_requeues == stats.requeued >= 1
    assert "engine unreachable for" in snap.last_errors["engine_requeues"]


async def _registered(registry: EngineRegistry) -> bool:
    return len(await registry.list()) == 1


async def _label(registry: EngineRegistry, label: str) -> bool:
    return [e.label for e in await registry.list()] == [label]


async def _version_seen(worker: RolloutWorker, version: int) -> bool:
    return worker.version == version and worker.engine_version == version


async def _true(value: bool) -> bool:
    return value


async def test_a_failing_engine_is_fenced_and_training_goes_on(tmp_path: Path, redis_url, env):
    """Before: three failed pushes in a row raised WeightSyncError and ended the job."""
    import torch

    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig
    from tests.support.trainer_support import model_and_tokenizer, tiny_model

    _, _, fakes = env
    fake = FakeSGLang(update_delay=2.0).start()  # no load finishes within the sync timeout
    fakes.append(fake)
    job = JobBuilder.small(name="fenced", batch_size=2, eta=1).job()
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c",
                      run_dir=tmp_path, pod_name="trainer-0")
    io = await connect_io(job, runtime)
    await io.registry.register(EngineInfo("pod-0", fake.url, 0, True, time.time(), incarnation="i0"))
    _, tok = model_and_tokenizer()
    model = tiny_model()
    cfg = RunConfig(engine_kind="sglang", weights_dir=runtime.weights_dir, checkpoint_dir=runtime.checkpoint_dir,
                    weight_sync_timeout_s=0.3)
    trainer = Trainer(job, cfg, DistContext(), model, torch.optim.AdamW(model.parameters()), tok, io=io)
    try:
        for version in (1, 2, 3):
            await trainer.publish(version)
        report = trainer.get_report()
        assert report.policy_version == 3 and report.rollout[0].fenced
        assert "fenced" in report.message
        assert [c for c in fake.state.control_calls if c.startswith("update")] == ["update:1"]  # left out since
    finally:
        await io.redis.aclose()


async def test_the_hf_server_names_its_incarnation():
    """Our hf server says which life it is in, so its worker knows a restart for sure."""
    from types import SimpleNamespace

    import httpx

    from asyncrl.rollout.engines.hf_server import create_app

    engine = SimpleNamespace(model_path="m", weight_label=WeightLabel(0), paused=False)
    seen = []
    for _ in range(2):  # two server starts
        app = create_app(engine, model_name="m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hf") as client:
            info = (await client.get("/model_info")).json()
            assert info == (await client.get("/model_info")).json()  # stable within one life
            seen.append(info["incarnation"])
    assert seen[0] and seen[0] != seen[1]
