"""Job-wide recovery counters (asyncrl/transport/recovery.py) and the trainer that keeps them, on a
real Redis: trainer starts, engines seen restarting (a new incarnation), engines re-synced."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.recovery import RecoveryCounters, RecoveryCounts
from asyncrl.transport.versions import EngineInfo
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import model_and_tokenizer, tiny_model

NAMES = StreamNames.for_job("job")


async def test_counters_add_up_and_refuse_unknown_names(transport_redis):
    counters = RecoveryCounters(transport_redis, NAMES)
    assert await counters.read() == RecoveryCounts()
    assert await counters.add("engine_restarts") == 1 and await counters.add("engine_restarts", 2) == 3
    assert await counters.read() == RecoveryCounts(engine_restarts=3)
    with pytest.raises(ValueError, match="allowed: trainer_starts, engine_restarts, engine_resyncs"):
        await counters.add("restarts")


async def test_the_trainer_counts_its_restarts_and_engines_coming_back(tmp_path, redis_url):
    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig

    job = JobBuilder.small(name="counted", batch_size=2).job()
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c",
                      run_dir=tmp_path, pod_name="trainer-0")
    _, tok = model_and_tokenizer()
    lives = []
    for _ in range(2):  # the first start, then a restart
        io = await connect_io(job, runtime)
        model = tiny_model()
        trainer = Trainer(job, RunConfig(engine_kind="hf", weights_dir=runtime.weights_dir,
                                         checkpoint_dir=runtime.checkpoint_dir),
                          DistContext(), model, torch.optim.AdamW(model.parameters()), tok, io=io)
        await trainer.engines.count_start()
        lives.append((io, trainer))
    io, trainer = lives[-1]
    try:
        registry = io.registry
        await registry.register(EngineInfo("e0", "http://e0:30000", 0, True, time.time(), incarnation="a"))
        await trainer.refresh_engines(catch_up_engines=False)
        await registry.register(EngineInfo("e0", "http://e0:30000", 0, True, time.time(), incarnation="b"))
        await trainer.refresh_engines(catch_up_engines=False)
        report = trainer.get_report().recovery
        assert (report.trainer_restarts, report.engine_restarts, report.engine_resyncs) == (1, 1, 0)
    finally:
        for io, _ in lives:
            await io.redis.aclose()
