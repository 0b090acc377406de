"""One owner of engine weights: the trainer updates every engine exactly once per version, the
rollout workers only observe. Two strict fake SGLang servers, a real Redis, a rollout worker per
engine generating all along, and the trainer-side sync (trainer/weights/engine_update.py) over 3 versions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.rollout.data.datasets import ArithmeticSource, PromptItem
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.trainer.weights.engine_update import WeightSyncError, catch_up, update_engines
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.transport.versions import EngineInfo, EngineRegistry, VersionChannel, VersionEvent
from asyncrl.transport.wire import decode_group
from tests.support.polling import poll
from tests.support.rollout_workers import WorkerEngine
from tests.support.sglang_fake import FakeSGLang, fake_version

JOB = "wsync"
VERSIONS = (1, 2, 3)
TOKEN_S = 0.004
SLOW_TOKEN_S = 0.5
"""Per token while an update is on its way: 30 tokens then take 15 s, far past the pause."""
UPDATE_CYCLE = ["pause:abort", "update:{v}", "continue"]


def render(item: PromptItem) -> list[int]:
    return [ord(c) % 200 + 3 for c in item.question][:12]


@pytest.fixture
async def env(redis_url):
    redis = await connect(redis_url)
    fakes = [FakeSGLang(token_delay=TOKEN_S).start() for _ in range(2)]
    yield redis, fakes, StreamNames.for_job(JOB)
    for fake in fakes:
        fake.state.paused = None  # let orphaned generations finish so the servers stop at once
    for fake in fakes:
        fake.stop()
    await redis.aclose()


def make_worker(redis, names, fake, index: int, *, labelled: bool) -> RolloutWorker:
    engine = WorkerEngine(fake.url, labelled=labelled)
    cfg = WorkerConfig(job=JOB, engine_id=f"pod-{index}", group_size=2, engine_url=fake.url,
                       sampling=SamplingParams(max_new_tokens=30), max_concurrent_requests=4, backoff_s=0.01,
                       heartbeat_s=0.1, log_every_s=60, rollout_index=index, rollout_replicas=2)
    admission = Admission(redis, names, batch_size=4, staleness=StalenessPolicy.global_budget(1000), max_concurrent=8,
                          lease_seconds=30)
    prompts = Mixture.single(ArithmeticSource(seed=0, difficulty=1), render, RewardScorer(exact_number_reward, 5.0))
    return RolloutWorker(cfg, engine=engine, redis=redis, prompts=prompts, decode=lambda ids: " ".join(map(str, ids)),
                         admission=admission, names=names)


@pytest.mark.parametrize("labelled", [True, False], ids=["sglang-labels", "unlabelled-like-vllm"])
async def test_one_update_per_engine_per_version_and_none_from_workers(env, tmp_path: Path, labelled: bool):
    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    channel = VersionChannel(redis, names)
    workers = [make_worker(redis, names, fake, i, labelled=labelled) for i, fake in enumerate(fakes)]
    runs = [asyncio.create_task(w.run()) for w in workers]

    async def registered():
        return len(await registry.list()) == 2

    await poll(registered, what="both engines registered")
    for v in VERSIONS:
        async def busy():  # every engine has a request part-way: the update cuts it (partial rollout)
            return all(any(n >= 1 for n in f.state.in_flight.values()) for f in fakes)

        for fake in fakes:  # slowed down, a part-way request cannot finish before the pause cuts it
            fake.state.token_delay = SLOW_TOKEN_S
        await poll(busy, what=f"requests part-way before version {v}")
        path = tmp_path / f"v{v}"
        await channel.publish(VersionEvent(version=v, weights_path=str(path), time=time.time()))
        result = await update_engines("sglang", await registry.list(), path, v, registry=registry, timeout_s=10)
        assert result.engines == 2
        for fake in fakes:
            fake.state.token_delay = TOKEN_S
        await Admission(redis, names, batch_size=4, staleness=StalenessPolicy.global_budget(1000),
                        max_concurrent=8).set_version(v)

    async def tagged_latest():  # groups generated on the newest weights are being published
        groups = [decode_group(f[b"data"]) for _, f in await redis.xrange(names.trajectories)]
        return {g.engine_id for g in groups if any(s.versions[-1] == VERSIONS[-1] for s in g.samples)} == \
            {"pod-0", "pod-1"}

    await poll(tagged_latest, what="groups tagged with the last version")

    async def observed():  # each worker's heartbeat reads its engine's version
        return all(w.engine_version == VERSIONS[-1] for w in workers)

    await poll(observed, what="workers observing the last version")
    for w in workers:
        w.stop()
    await asyncio.wait_for(asyncio.gather(*runs), 30)
    for w in workers:
        await w.engine.close()

    for fake in fakes:  # exactly one pause -> update -> continue per engine per version, in order
        expected = [c.format(v=v) for v in VERSIONS for c in UPDATE_CYCLE]
        assert fake.state.control_calls == expected
        assert [u["weight_version"] for u in fake.state.update_calls] == [str(v) for v in VERSIONS]
    for w in workers:  # the workers issued none, and observed the version
        assert w.engine.control == []  # type: ignore[attr-defined]
        assert w.version == VERSIONS[-1]
    records = await registry.all_weights()
    assert {k: (r.version, r.updating, r.epoch) for k, r in records.items()} == \
        {"pod-0": (3, None, 3), "pod-1": (3, None, 3)}

    groups = [decode_group(f[b"data"]) for _, f in await redis.xrange(names.trajectories)]
    spanning = 0
    for g in groups:
        for s in g.samples:
            versions = [int(x) for x in s.versions]
            assert versions == sorted(versions)
            # each token's tag is the version of the weights the fake used for it
            assert versions == [fake_version(lp) for lp in s.behav_logprobs]
            spanning += len(set(versions)) > 1
    assert spanning >= 1  # tokens after an abort + resume carry the new version
    # every update cut a part-way request on every engine, and the worker continued it
    assert all(w.stats.interrupted >= len(VERSIONS) for w in workers)


async def test_catch_up_gives_a_new_engine_the_current_version_once(env, tmp_path: Path):
    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    (tmp_path / "v3").mkdir()
    now = time.time()
    await registry.register(EngineInfo("pod-0", fakes[0].url, 0, True, now))
    await update_engines("sglang", await registry.list(), tmp_path / "v3", 3, registry=registry, timeout_s=10)
    await registry.register(EngineInfo("pod-1", fakes[1].url, 0, True, now))  # joined late, on its base weights

    assert await catch_up("sglang", registry, tmp_path / "v3", 3, timeout_s=10) == [fakes[1].url]
    assert await catch_up("sglang", registry, tmp_path / "v3", 3, timeout_s=10) == []
    assert fakes[0].state.control_calls == fakes[1].state.control_calls == ["pause:abort", "update:3", "continue"]
    # no directory for the version (the base model, version 0): nothing to load
    assert await catch_up("sglang", registry, tmp_path / "v0", 0, timeout_s=10) == []


async def test_a_failed_update_names_the_engine_resumes_it_and_keeps_its_record(env):
    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    now = time.time()
    for i, fake in enumerate(fakes):
        await registry.register(EngineInfo(f"pod-{i}", fake.url, 0, True, now))
    with pytest.raises(WeightSyncError) as err:  # the fake refuses paths under /nonexistent
        await update_engines("sglang", await registry.list(), Path("/nonexistent/v1"), 1, registry=registry,
                             timeout_s=10)
    assert set(err.value.failures) == {f.url for f in fakes}
    for fake in fakes:
        assert fake.state.control_calls == ["pause:abort", "update:1", "continue"]
        assert fake.state.paused is None
    for rec in (await registry.all_weights()).values():
        assert (rec.version, rec.updating, rec.epoch, rec.in_progress()) == (None, None, 1, False)
    assert [e.engine_id for e in await registry.list()] == ["pod-0", "pod-1"]  # they answered: still registered


async def test_an_engine_nothing_answers_for_is_unregistered(env, tmp_path: Path):
    """A dead pod's entry (its worker could not deregister) must not fail publish after publish until its
    heartbeat is too old: the trainer unregisters it; a live worker would register it again."""
    from asyncrl.infra.net import free_port

    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    (tmp_path / "v1").mkdir()
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    now = time.time()
    await registry.register(EngineInfo("pod-0", fakes[0].url, 0, True, now))
    await registry.register(EngineInfo("pod-gone", gone, 0, True, now))
    with pytest.raises(WeightSyncError) as err:
        await update_engines("sglang", await registry.list(), tmp_path / "v1", 1, registry=registry, timeout_s=10)
    assert list(err.value.failures) == [gone] and "unregistered" in err.value.failures[gone]
    assert [e.engine_id for e in await registry.list()] == ["pod-0"]
    assert fakes[0].state.control_calls == ["pause:abort", "update:1", "continue"]
    await update_engines("sglang", await registry.list(), tmp_path / "v1", 1, registry=registry, timeout_s=10)
