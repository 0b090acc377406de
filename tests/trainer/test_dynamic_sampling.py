"""DAPO's dynamic sampling in the trainer (spec.algorithm.dynamicSampling), against a real Redis.

Groups whose rewards are all equal carry no signal: with dynamic sampling the trainer skips them
(acknowledged, admission capacity returned, counted) and keeps reading until the batch has
batchSize groups with signal, or trains on fewer after `dynamicSampling.maxDraws` draws. The trainer
runs on the tiny one-layer copy of SmolLM2 (tests/support/trainer_support.py): a step takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.transport.streams import trained_ids
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import chat_groups, read_jsonl, redis_query, run_trainer_on_groups

JOB = "t-dynamic"


def groups_with(rewards: dict[str, list[float]]) -> list[Any]:
    """Groups named by `rewards`' keys, in that (creation) order, with those sample rewards."""
    out = []
    for group, (gid, values) in zip(chat_groups(JOB, len(rewards)), rewards.items()):
        samples = [dataclasses.replace(s, reward=r) for s, r in zip(group.samples, values)]
        out.append(dataclasses.replace(group, group_id=gid, samples=samples))
    return out


NONE, ONES, MIXED = [0.0] * 4, [1.0] * 4, [0.0, 1.0, 0.0, 1.0]


def run_trainer(tmp_path: Path, redis_url: str, groups: list[Any], *, max_steps: int,
                algorithm: dict[str, Any]) -> tuple[Any, list[list[str]]]:
    """Publish `groups`, run a trainer for `max_steps`; returns it and the group ids of each batch
    that entered a training step."""
    job = JobBuilder.small(name=JOB, batch_size=2, eta=8, max_steps=max_steps, checkpoint_interval=1,
                           algorithm=algorithm).job()
    trainer, steps = run_trainer_on_groups(tmp_path, redis_url, job, groups)
    return trainer, [fresh for fresh, _ in steps]


def redis_state(redis_url: str) -> tuple[set[str], int, int, int]:
    """(group ids acknowledged, entries pending, admission's accepted, admission's dropped)."""
    from asyncrl.api.stream_names import StreamNames

    names = StreamNames.for_job(JOB)

    async def q(r: Any) -> tuple[set[str], int, int, int]:
        acked = await trained_ids(r, names)
        pending = (await r.xpending(names.trajectories, names.consumer_group))["pending"]
        accepted = int(await r.hget(names.admission, "accepted") or 0)
        return acked, pending, accepted, int(await r.hget(names.admission, "dropped") or 0)

    return redis_query(redis_url, q)


def admission_drift(redis_url: str, trained_acked: int) -> int:
    """What admission's reconciliation measures (asyncrl/transport/admission.py), without repairing."""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.admission import Admission

    async def q(r: Any) -> int:
        admission = Admission(r, StreamNames.for_job(JOB), batch_size=2, staleness=StalenessPolicy.global_budget(8),
                              max_concurrent=18)
        return (await admission.reconcile(trained_acked)).drift

    return redis_query(redis_url, q)


def test_zero_signal_groups_are_skipped_acked_counted_and_give_capacity_back(tmp_path: Path,
                                                                            redis_url: str) -> None:
    from asyncrl.trainer.report.prometheus import TrainerMetrics
    from asyncrl.trainer.report.status_api import status_document

    groups = groups_with({"z0": NONE, "i0": MIXED, "z1": ONES, "i1": MIXED, "i2": MIXED, "z2": NONE,
                          "i3": MIXED})
    trainer, batches = run_trainer(tmp_path, redis_url, groups, max_steps=2, algorithm={"dynamicSampling": {}})

    assert batches == [["i0", "i1"], ["i2", "i3"]]  # only groups with signal, the batch kept full
    acked, pending, accepted, dropped = redis_state(redis_url)
    assert acked == {g.group_id for g in groups} and pending == 0  # the skipped ones too: nothing lost
    assert (accepted, dropped) == (4, 3)  # the 3 skipped gave their admission capacity back
    assert admission_drift(redis_url, trained_acked=4) == 0  # reconciliation agrees: nothing leaked
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [x["zero_signal_groups"] for x in lines] == [2, 1]
    assert [x["zero_signal_groups_total"] for x in lines] == [2, 3]
    assert [x["zero_signal_fraction"] for x in lines] == [0.5, 1 / 3]
    assert [x["dynamic_sampling_starved"] for x in lines] == [0, 0]
    assert [x["reward_mean"] for x in lines] == [0.5, 0.5]  # the trained batch
    assert lines[0]["reward_mean_drawn"] == (0 + 0.5 + 1 + 0.5) / 4  # every group drawn for the step
    report = trainer.get_report()
    assert (report.zero_signal_groups, report.dynamic_sampling_starved_steps) == (3, 0)
    assert report.groups_trained == 4 and [h.zero_signal_groups for h in report.history] == [2, 1]
    assert status_document(report)["zero_signal_groups"] == 3
    metrics = TrainerMetrics()
    metrics.update(report)
    assert metrics.registry.get_sample_value("asyncrl_trainer_zero_signal_groups_skipped_total") == 3
    assert metrics.registry.get_sample_value("asyncrl_trainer_zero_signal_fraction") == 1 / 3


def test_a_starving_step_trains_what_it_has_after_max_draws(tmp_path: Path, redis_url: str, caplog: Any) -> None:
    """maxDraws 3, batchSize 2: step 1 draws z0 z1 (skipped) and i0, and trains on i0 alone; step 2
    draws z2 z3 z4 (skipped): none had signal, so it takes the next group whatever its rewards, z5
    (advantage 0), rather than wait; i1 stays buffered for the next step."""
    from asyncrl.trainer.report.prometheus import TrainerMetrics

    groups = groups_with({"z0": NONE, "z1": ONES, "i0": MIXED, "z2": NONE, "z3": NONE, "z4": ONES, "z5": NONE,
                          "i1": MIXED})
    with caplog.at_level(logging.WARNING, logger="asyncrl.trainer"):
        trainer, batches = run_trainer(tmp_path, redis_url, groups, max_steps=2,
                                       algorithm={"dynamicSampling": {"maxDraws": 3}})

    assert batches == [["i0"], ["z5"]]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [x["dynamic_sampling_starved"] for x in lines] == [1, 1]
    assert [x["zero_signal_groups"] for x in lines] == [2, 3]
    assert [x["zero_signal_fraction"] for x in lines] == [2 / 3, 1.0]
    report = trainer.get_report()
    assert (report.dynamic_sampling_starved_steps, report.zero_signal_groups, report.groups_trained) == (2, 5, 2)
    metrics = TrainerMetrics()
    metrics.update(report)
    assert metrics.registry.get_sample_value("asyncrl_trainer_dynamic_sampling_starved_steps_total") == 2
    starving = [r.getMessage() for r in caplog.records if "dynamicSampling.maxDraws=3" in r.getMessage()]
    assert len(starving) == 2 and "1 with signal" in starving[0] and "0 with signal" in starving[1]
    acked, _, accepted, dropped = redis_state(redis_url)
    assert acked == {"z0", "z1", "z2", "z3", "z4", "z5", "i0"}  # not i1: left for step 3
    assert (accepted, dropped) == (8 - 5, 5)


def test_without_dynamic_sampling_zero_signal_groups_are_trained_at_advantage_zero(tmp_path: Path,
                                                                                   redis_url: str) -> None:
    from asyncrl.trainer.step.plan import sequences_with_advantages

    groups = groups_with({"z0": NONE, "i0": MIXED, "z1": ONES, "i1": MIXED})
    trainer, batches = run_trainer(tmp_path, redis_url, groups, max_steps=2, algorithm={})

    assert batches == [["z0", "i0"], ["z1", "i1"]]  # today's behaviour: the B oldest, whatever the rewards
    for estimator in ("grpo", "dr_grpo", "rloo"):
        algo = JobBuilder.small(algorithm={"advantageEstimator": estimator}).job().spec.algorithm
        advantages = [s.advantage for s in sequences_with_advantages(groups[:2], algo)]
        assert advantages[:4] == [0.0] * 4 and any(advantages[4:])  # z0 contributes nothing
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [x["zero_signal_groups"] for x in lines] == [0, 0]
    assert [x["zero_signal_fraction"] for x in lines] == [0.5, 0.5]  # what dynamic sampling would skip
    assert trainer.get_report().zero_signal_groups == 0
    _, pending, accepted, dropped = redis_state(redis_url)
    assert (pending, accepted, dropped) == (0, 4, 0)
