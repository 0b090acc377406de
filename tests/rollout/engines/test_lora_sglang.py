"""A LoRA job on SGLang: each version is an adapter the trainer loads into every engine by name, and
every request names the adapter it uses, so every answer carries the version that produced it.

Two strict fake SGLang servers started with the pin's LoRA flags (tests/support/sglang_fake_lora.py:
the pin's adapter routes, registry and checks), a real Redis, a rollout worker per engine generating
all along, and the trainer-side sync (trainer/weights/engine_update.py) with `adapters=True` over 3 versions.
The fake computes an adapter's logprobs from its directory (`.../v3` -> version 3), so each token's
logprob says which directory produced it, whatever the name on the answer.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from asyncrl.api.spec.lora import SGLANG_ALL_LINEAR
from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from asyncrl.rollout.data.datasets import ArithmeticSource, PromptItem
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines import EngineError, SamplingParams, make_engine
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.trainer.weights.engine_update import WeightSyncError, catch_up, update_engines
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.transport.versions import EngineRegistry, VersionChannel, VersionEvent
from asyncrl.transport.wire import decode_group
from tests.support.polling import poll
from tests.support.sglang_fake import FakeSGLang, fake_version
from tests.support.sglang_fake_lora import NOT_ENABLED, LoraLaunch

JOB = "lora-sglang"
LAUNCH = LoraLaunch(max_lora_rank=16, target_modules=SGLANG_ALL_LINEAR)
TOKEN_S = 0.004
SLOW_TOKEN_S = 0.5


def adapter_dir(root: Path, version: int, *, rank: int = 16, modules: list[str] | str | None = None) -> Path:
    """A version's adapter directory as the trainer publishes it (PEFT's two files; the fake reads the config)."""
    path = root / f"v{version}"
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 32,
              "target_modules": modules if modules is not None else list(SGLANG_ALL_LINEAR)}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))
    (path / ADAPTER_WEIGHTS).write_bytes(b"\0" * 8)
    return path


def render(item: PromptItem) -> list[int]:
    return [ord(c) % 200 + 3 for c in item.question][:12]


@pytest.fixture
async def env(redis_url):
    redis = await connect(redis_url)
    fakes = [FakeSGLang(token_delay=TOKEN_S, lora=LAUNCH).start() for _ in range(2)]
    yield redis, fakes, StreamNames.for_job(JOB)
    for fake in fakes:
        fake.state.paused = None
    for fake in fakes:
        fake.stop()
    await redis.aclose()


def make_worker(redis, names, fake, index: int, *, bound: int = 1000) -> RolloutWorker:
    cfg = WorkerConfig(job=JOB, engine_id=f"pod-{index}", group_size=2, engine_url=fake.url,
                       sampling=SamplingParams(max_new_tokens=30), max_concurrent_requests=4, backoff_s=0.01,
                       heartbeat_s=0.1, log_every_s=60, rollout_index=index, rollout_replicas=2)
    admission = Admission(redis, names, batch_size=4, staleness=StalenessPolicy.global_budget(bound), max_concurrent=8,
                          lease_seconds=30)
    prompts = Mixture.single(ArithmeticSource(seed=0, difficulty=1), render, RewardScorer(exact_number_reward, 5.0))
    return RolloutWorker(cfg, engine=make_engine("sglang", fake.url, adapters=True), redis=redis, prompts=prompts,
                         decode=lambda ids: " ".join(map(str, ids)), admission=admission, names=names)


async def groups_of(redis, names) -> list:
    return [decode_group(f[b"data"]) for _, f in await redis.xrange(names.trajectories)]


async def test_each_version_is_an_adapter_every_answer_names_and_old_ones_are_unloaded(env, tmp_path: Path):
    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    channel = VersionChannel(redis, names)
    workers = [make_worker(redis, names, fake, i) for i, fake in enumerate(fakes)]
    runs = [asyncio.create_task(w.run()) for w in workers]
    await poll(lambda: _count(registry.list(), 2), what="both engines registered")
    versions = (1, 2, 3)
    for v in versions:
        async def busy():  # every engine has a request part-way: the update cuts it
            return all(any(n >= 1 for n in f.state.in_flight.values()) for f in fakes)

        for fake in fakes:
            fake.state.token_delay = SLOW_TOKEN_S
        await poll(busy, what=f"requests part-way before version {v}")
        path = adapter_dir(tmp_path / "weights", v)
        await channel.publish(VersionEvent(version=v, weights_path=str(path), time=time.time()))
        result = await update_engines("sglang", await registry.list(), path, v, registry=registry, timeout_s=10,
                                      adapters=True)
        assert result.engines == 2
        for fake in fakes:
            fake.state.token_delay = TOKEN_S

    async def named_latest():  # both workers generate on the last adapter
        return {g.engine_id for g in await groups_of(redis, names)
                if any(s.versions[-1] == versions[-1] for s in g.samples)} == {"pod-0", "pod-1"}

    await poll(named_latest, what="groups tagged with the last adapter's version")
    for w in workers:
        w.stop()
    await asyncio.wait_for(asyncio.gather(*runs), 30)
    for w in workers:
        await w.engine.close()

    for fake in fakes:
        # the base model's label never moves; one load per version; v1 unloaded once v3 came (v2 kept)
        assert fake.state.weight_version == "default" and fake.state.update_calls == []
        assert [c for c in fake.state.adapters.calls if not c.startswith("reload")] == \
            ["load:1", "load:2", "load:3", "unload:1"]
        assert fake.state.adapters.loaded == {"2": str(tmp_path / "weights" / "v2"),
                                              "3": str(tmp_path / "weights" / "v3")}
        assert fake.state.control_calls.count("pause:abort") == len(versions)
        named = {c["lora_path"] for c in fake.state.generate_calls if c.get("lora_path")}
        assert named <= {"1", "2", "3"} and "3" in named
    spanning = 0
    for g in await groups_of(redis, names):
        for s in g.samples:
            versions_seen = [int(x) for x in s.versions]
            assert versions_seen == sorted(versions_seen)
            # each token's version is that of the adapter directory that produced it (0: the base model)
            assert versions_seen == [fake_version(lp) for lp in s.behav_logprobs]
            spanning += len(set(versions_seen)) > 1
    assert spanning >= 1  # an update cut a request; its continuation named the new adapter
    for w in workers:
        assert w.engine_version == versions[-1]


async def _count(awaitable, n: int) -> bool:
    return len(await awaitable) == n


async def test_a_restarted_engine_serves_the_base_until_catch_up_loads_the_current_adapter(env, tmp_path: Path):
    redis, fakes, names = env
    registry = EngineRegistry(redis, names)
    path = adapter_dir(tmp_path / "weights", 2)
    await Admission(redis, names, batch_size=4, staleness=StalenessPolicy.global_budget(0),
                    max_concurrent=8).set_version(2)
    await VersionChannel(redis, names).publish(VersionEvent(version=2, weights_path=str(path), time=time.time()))
    worker = make_worker(redis, names, fakes[0], 0, bound=0)
    run = asyncio.create_task(worker.run())
    await poll(lambda: _count(registry.list(), 1), what="the engine registered")
    await update_engines("sglang", await registry.list(), path, 2, registry=registry, timeout_s=10, adapters=True)
    await poll(lambda: worker.engine_version == 2, what="the worker serves v2")
    fakes[0].restart()  # a new process: the LoRA flags, no adapter, the base model ("default", version 0)
    assert fakes[0].state.adapters.loaded == {} and fakes[0].state.lora == LAUNCH
    await poll(lambda: worker.engine_version == 0, what="the worker sees the base model again")
    requests = fakes[0].state.requests
    await asyncio.sleep(0.5)
    assert fakes[0].state.requests == requests, "no request on the base model, 2 versions behind the policy"
    assert await catch_up("sglang", registry, path, 2, timeout_s=10, adapters=True) == [fakes[0].url]
    assert fakes[0].state.adapters.calls == ["load:2"]
    await poll(lambda: worker.engine_version == 2 and worker.stats.requests > 0, what="generating on v2 again")
    worker.stop()
    await asyncio.wait_for(run, 30)
    await worker.engine.close()
    assert all(c.get("lora_path") == "2" for c in fakes[0].state.generate_calls)


async def test_an_unloaded_adapter_is_reloaded_from_its_path_or_refused_and_the_request_looks_again(env, tmp_path):
    _, fakes, _ = env
    fake = fakes[0]
    engine = make_engine("sglang", fake.url, adapters=True)
    assert isinstance(engine, SGLangEngine)
    params = SamplingParams(max_new_tokens=3)
    weights = tmp_path / "weights"
    await engine.update_weights(str(adapter_dir(weights, 1)), 1)
    assert (await engine.generate([5, 6], params)).weight_version == 1
    # the trainer moves on (v2, v3): v1 is unloaded, but this client still names it (its list is fresh)
    trainer = make_engine("sglang", fake.url, adapters=True)
    await trainer.update_weights(str(adapter_dir(weights, 2)), 2)
    await trainer.update_weights(str(adapter_dir(weights, 3)), 3)
    assert "1" not in fake.state.adapters.loaded
    engine._adapters_read = time.monotonic()  # (as if it had listed the adapters a moment before the unload)
    engine._adapter = "1"
    answer = await engine.generate([5, 6], params)  # the pin loads it again from its remembered path
    assert (answer.weight_version, fake_version(answer.logprobs[0])) == (1, 1)
    assert fake.state.adapters.calls[-1] == "reload:1"
    await trainer.update_weights(str(weights / "v3"), 3)  # the next update unloads it again
    shutil.rmtree(weights / "v1")  # ... and then its directory is gone (weights retention)
    engine._adapters_read, engine._adapter = time.monotonic(), "1"
    with pytest.raises(EngineError, match="Failed to implicitly load LoRA adapter 1") as err:
        await engine.generate([5, 6], params)
    assert err.value.retryable, "a refused adapter name is retried, on a fresh list"
    answer = await engine.generate([5, 6], params)
    assert (answer.weight_version, fake_version(answer.logprobs[0])) == (3, 3)
    await engine.close()
    await trainer.close()


async def test_the_fake_refuses_what_the_pin_refuses(tmp_path: Path):
    plain = FakeSGLang().start()  # no --enable-lora
    strict = FakeSGLang(lora=LoraLaunch(max_lora_rank=8, target_modules=("q_proj", "v_proj"))).start()
    try:
        engine = make_engine("sglang", plain.url, adapters=True)
        with pytest.raises(EngineError, match="LoRA is not enabled"):
            await engine.update_weights(str(adapter_dir(tmp_path, 1)), 1)
        assert plain.state.adapters.loaded == {}
        with pytest.raises(EngineError, match="but LoRA is not enabled"):
            await engine._json("POST", "/generate", json={"input_ids": [1], "lora_path": "1"})  # type: ignore[attr-defined]
        await engine.close()
        engine = make_engine("sglang", strict.url, adapters=True)
        with pytest.raises(EngineError, match="rank 16 is incompatible"):
            await engine.update_weights(str(adapter_dir(tmp_path / "a", 1, rank=16, modules=["q_proj"])), 1)
        with pytest.raises(EngineError, match=r"target modules \['gate_up_proj'\] that are not included"):
            await engine.update_weights(str(adapter_dir(tmp_path / "b", 1, rank=8, modules=["q_proj", "up_proj"])), 1)
        with pytest.raises(EngineError, match=r"Can't find 'adapter_config\.json'"):
            await engine.update_weights(str(tmp_path / "nowhere"), 1)
        await engine.update_weights(str(adapter_dir(tmp_path / "c", 1, rank=8, modules="all-linear")), 1)
        direct = await engine._json_lenient("/load_lora_adapter",  # type: ignore[attr-defined]
                                            {"lora_name": "1", "lora_path": str(tmp_path / "c" / "v1")})
        assert direct["success"] is False and "because it is already loaded" in direct["error_message"]
        with pytest.raises(EngineError, match="has never been loaded: 9"):
            await engine._json("POST", "/generate", json={"input_ids": [1], "lora_path": "9"})  # type: ignore[attr-defined]
        await engine.close()
        with pytest.raises(WeightSyncError, match=NOT_ENABLED.split(".")[0]) as err:  # it names the engine
            await update_engines("sglang", [plain.url], adapter_dir(tmp_path / "d", 2), 2, timeout_s=10,
                                 adapters=True)
        assert list(err.value.failures) == [plain.url]
    finally:
        plain.stop()
        strict.stop()
