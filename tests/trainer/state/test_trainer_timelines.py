"""No group is trained under the label of weights a trainer restart threw away.

The window, reproduced deterministically: a trainer life (timeline 0) checkpointed v4, published v5
and was killed before checkpointing it; an engine went on generating on that v5 until the resumed
trainer put it back on v4. The resumed trainer (a real one, on a real Redis) starts timeline 1,
drops every group with a token of the dead v5 (a partial rollout whose first segment was on it
too), counts them, gives admission their capacity back and trains only what its lineage produced;
the labels it publishes from then on say timeline 1."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.api.stream_names import StreamNames
from asyncrl.api.weight_labels import WeightLabel
from asyncrl.trainer.state.checkpoint import TRAINED_LOG, TrainerState
from asyncrl.trainer.state.timelines import TIMELINE_FILE
from asyncrl.transport.recovery import RecoveryCounters
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import chat_groups, model_and_tokenizer, publish, redis_query, tiny_model

JOB = "t-timelines"


def _relabel(group: Any, group_id: str, versions: list[int], timelines: list[int] | None = None) -> Any:
    """`group` under another id, each sample's tokens labelled by halves: first half versions[0], the
    rest versions[-1] (of timelines[0] / timelines[-1])."""
    samples = []
    for s in group.samples:
        half = len(s.versions) // 2
        v = np.array([versions[0]] * half + [versions[-1]] * (len(s.versions) - half), dtype=np.int32)
        t = None if timelines is None else np.array([timelines[0]] * half + [timelines[-1]] * (len(v) - half),
                                                    dtype=np.int32)
        samples.append(dataclasses.replace(s, versions=v, timelines=t))
    return dataclasses.replace(group, group_id=group_id, samples=samples)


def _resume(tmp_path: Path, redis_url: str, groups: list[Any], state: TrainerState, max_steps: int) -> Any:
    """A trainer of the tiny model resumed at `state` (its checkpoint dir says timeline 0 was the
    last started) on `groups`, run to `max_steps`."""
    import torch

    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig

    job = JobBuilder.small(name=JOB, batch_size=2, max_steps=max_steps, checkpoint_interval=1).job()
    publish(redis_url, JOB, groups)
    names = StreamNames.for_job(JOB)

    async def accept(r: Any) -> None:
        await r.hset(names.admission, "accepted", len(groups))

    redis_query(redis_url, accept)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / TIMELINE_FILE).write_text(json.dumps({"last": 0}))
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                      run_dir=tmp_path, pod_name="trainer-0")

    async def go() -> Any:
        _, tok = model_and_tokenizer()
        model = tiny_model()
        cfg = RunConfig(engine_kind="hf", weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                        metrics_path=tmp_path / "metrics.jsonl", read_block_ms=50)
        io = await connect_io(job, runtime)
        trainer = Trainer(job, cfg, DistContext(), model, torch.optim.AdamW(model.parameters(), lr=1e-3), tok,
                          io=io, state=state)
        try:
            assert await trainer.run() == "Succeeded"
            trainer.admission_after = await io.admission.snapshot()
            trainer.pending_after = (await io.redis.xpending(names.trajectories, names.consumer_group))["pending"]
            trainer.timeline_in_redis = await RecoveryCounters(io.redis, names).last_timeline()
        finally:
            await io.redis.aclose()
        return trainer

    return asyncio.run(go())


def test_groups_of_the_dead_timeline_are_dropped_and_the_live_ones_trained(tmp_path: Path, redis_url: str) -> None:
    base = chat_groups(JOB, 1)[0]
    live = [_relabel(base, "v4-a", [4]), _relabel(base, "v3-4", [3, 4])]      # this lineage's weights
    ghosts = [_relabel(base, "v5-dead", [5]),                                 # the dead life's v5
              _relabel(base, "v4-then-5", [4, 5])]                            # continued on it
    trainer = _resume(tmp_path, redis_url, [*ghosts, *live], TrainerState(step=4, version=4), max_steps=5)

    lines = [json.loads(x) for x in (tmp_path / "ckpt" / TRAINED_LOG).read_text().splitlines()]
    assert [(x["step"], x["timeline"], sorted(x["group_ids"])) for x in lines] == [(5, 1, ["v3-4", "v4-a"])]
    report = trainer.get_report()
    assert report.recovery.ghost_groups_dropped == 2 and report.timeline == 1
    assert trainer.lineage.shared_until == {0: 4} and trainer.state.timeline == 1
    assert json.loads((tmp_path / "ckpt" / TIMELINE_FILE).read_text()) == {"last": 1}
    assert trainer.timeline_in_redis == 1
    assert trainer.pending_after == 0  # every ghost acknowledged, as a dropped group is
    assert trainer.admission_after.dropped == 2  # (their capacity given back, as for over-stale groups)
    assert trainer.publisher.lineage.label(5) == WeightLabel(5, 1)  # what engines are told from now on


def test_a_life_that_died_before_its_first_checkpoint_leaves_only_the_base_model(tmp_path: Path,
                                                                                   redis_url: str) -> None:
    """No checkpoint to resume: the dead life's v1 (timeline 0) is no one's; version 0 is everyone's,
    and so are the live timeline's own labels."""
    base = chat_groups(JOB, 1)[0]
    groups = [_relabel(base, "v1-dead", [1]), _relabel(base, "v0", [0]),
              _relabel(base, "v0-then-1@1", [0, 1], [0, 1]), _relabel(base, "v0-b", [0])]
    trainer = _resume(tmp_path, redis_url, groups, TrainerState(), max_steps=1)
    lines = [json.loads(x) for x in (tmp_path / "ckpt" / TRAINED_LOG).read_text().splitlines()]
    assert [sorted(x["group_ids"]) for x in lines] == [["v0", "v0-then-1@1"]]
    assert trainer.get_report().recovery.ghost_groups_dropped == 1
    assert trainer.lineage.shared_until == {0: 0}
