"""ROLL Flash's asynchronous ratio alpha as a staleness policy (issue 20, part 4): the arithmetic,
the trainer-side drop against a real Redis server, and a run of steps that keeps to the bound."""

from __future__ import annotations

import pytest

from asyncrl.api.spec import AsyncRLJobSpec
from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.trainer.inbox import GroupInbox
from asyncrl.transport.admission import Admission
from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer
from tests.support.jobs import JobBuilder

NAMES = StreamNames.for_job("job")


@pytest.mark.parametrize("alpha, batch, ahead, bound, quota", [
    (0.0, 4, 0, 0, None),    # synchronous
    (0.5, 4, 2, 1, 2),       # half a batch ahead; of version v-1 at most 2 groups per step
    (0.5, 5, 3, 1, 2),       # ROLL: ceil(alpha B) ahead, int(frac B) at the bound
    (1.0, 4, 4, 1, None),    # integer alpha = eta
    (1.5, 4, 6, 2, 2),
    (2.0, 8, 16, 2, None),
    (0.1, 30, 3, 1, 3),      # the decimal written: float 0.1 * 30 is 3.0000000000000004
    (0.25, 3, 1, 1, 0),      # the bound's version contributes nothing when floor(frac B) = 0
])
def test_per_sample_arithmetic(alpha, batch, ahead, bound, quota):
    policy = StalenessPolicy.per_sample(alpha)
    assert policy.groups_ahead(batch) == ahead
    assert policy.version_bound == bound
    assert policy.boundary_quota(batch) == quota
    # eta is the global budget's: a per-sample policy given another eta computes the same
    assert StalenessPolicy("per-sample", eta=99, alpha=alpha).groups_ahead(batch) == ahead


def test_global_budget_arithmetic_is_eta():
    policy = StalenessPolicy.global_budget(3)
    assert policy.groups_ahead(4) == 12
    assert policy.version_bound == 3
    assert policy.boundary_quota(4) is None
    with pytest.raises(ValueError, match="asyncRatio"):
        StalenessPolicy.per_sample(-0.5)


@pytest.mark.parametrize("kind, eta, alpha, says", [
    ("per-sample", 4, None, "needs asyncRatio"),
    ("global-budget", 4, 0.5, "needs policy 'per-sample'"),
    ("global-budget", -1, None, "maxHeadOffpolicyness"),
    ("per-sample", 4, float("inf"), "asyncRatio"),
])
def test_a_policy_is_consistent_or_refused(kind, eta, alpha, says):
    with pytest.raises(ValueError, match=says):
        StalenessPolicy(kind, eta=eta, alpha=alpha)


@pytest.mark.parametrize("oldest, current, bound, dropped", [
    (3, 5, 1, True),     # 5 - 3 = 2 > 1
    (3, 5, 2, False),
    (3, 6, 2, True),
    (-1, 100, 0, False),  # no generated tokens: no staleness
])
def test_too_stale_compares_the_oldest_token_with_the_bound(oldest, current, bound, dropped):
    assert StalenessPolicy.global_budget(bound).too_stale(oldest, current) is dropped


@pytest.mark.parametrize("staleness, policy", [
    ({}, StalenessPolicy.global_budget(4)),
    ({"maxHeadOffpolicyness": 0}, StalenessPolicy.global_budget(0)),
    ({"policy": "per-sample", "asyncRatio": 0.5}, StalenessPolicy.per_sample(0.5)),
])
def test_the_spec_chooses_the_policy(staleness, policy):
    assert AsyncRLJobSpec(model={"path": "m"}, staleness=staleness).staleness.as_policy() == policy


def setup(redis, *, batch: int, eta: int = 4, alpha: float | None = None) -> tuple[Admission, GroupInbox]:
    policy = StalenessPolicy.global_budget(eta) if alpha is None else StalenessPolicy.per_sample(alpha)
    adm = Admission(redis, NAMES, batch_size=batch, staleness=policy, max_concurrent=64)
    consumer = TrajectoryConsumer(redis, NAMES, "trainer-0")
    inbox = GroupInbox(consumer, adm, batch_size=batch, read_block_ms=50)
    assert inbox.staleness is adm.staleness  # the inbox drops by the policy admission admits by
    return adm, inbox


async def produce(adm: Admission, redis, group) -> None:
    """What a rollout worker does per group: lease, publish, release as accepted."""
    lease = await adm.try_acquire("rollout-0")
    assert lease is not None, "admission refused a group"
    await TrajectoryProducer(redis, NAMES).publish(group)
    await adm.release(lease, accepted=True)


async def read_all(inbox: GroupInbox, n: int) -> None:
    while len(inbox.buffer) < n:
        await inbox.read()


async def pending(redis) -> int:
    return int((await redis.xpending(NAMES.trajectories, NAMES.consumer_group))["pending"])


VERSIONS = {"a0": 0, "b0": 0, "c1": 1, "d1": 1, "e1": 1, "f2": 2}


@pytest.mark.parametrize("alpha, eta, dropped", [
    # per-sample alpha 0.5, B 4: bound ceil(0.5) = 1 version; of version 1 (= 2 - 1) the oldest
    # floor(0.5 * 4) = 2 stay (c1, d1), e1 is dropped with the version-0 groups
    (0.5, 4, ["a0", "b0", "e1"]),
    (1.0, 4, ["a0", "b0"]),        # integer alpha: the whole bound version stays
    (None, 1, ["a0", "b0"]),       # global budget, eta 1: unchanged
    (None, 2, []),
])
async def test_drop_discards_exactly_the_over_old_groups_and_gives_their_capacity_back(
        transport_redis, make_trajectory_group, alpha, eta, dropped):
    adm, inbox = setup(transport_redis, batch=4, eta=eta, alpha=alpha)
    await adm.set_version(2)  # (room for the six groups under every policy here)
    for gid, v in VERSIONS.items():
        await produce(adm, transport_redis, make_trajectory_group(gid, version=v))
    await read_all(inbox, len(VERSIONS))
    before = await adm.snapshot()

    assert await inbox.drop_stale(2) == len(dropped)
    assert sorted(d.group.group_id for d in inbox.buffer) == sorted(set(VERSIONS) - set(dropped))
    after = await adm.snapshot()
    assert after.dropped == len(dropped)
    assert after.accepted == before.accepted - len(dropped)      # capacity comes back...
    assert after.capacity == before.capacity + len(dropped)
    assert await pending(transport_redis) == len(VERSIONS) - len(dropped)  # ...and they are acked
    assert await inbox.drop_stale(2) == 0  # idempotent: what stays is within the bound


async def run_steps(redis, *, batch: int, alpha: float, steps: int) -> tuple[list[list[int]], list[int]]:
    """A synchronous picture of the job: at each version the producer fills every slot admission
    grants (a replacement for each group dropped included), then the trainer takes one batch the
    way `Trainer.next_batch` does. Returns each batch's versions and each step's drops."""
    adm, inbox = setup(redis, batch=batch, alpha=alpha)
    made, batches, drops = 0, [], []
    for version in range(steps):
        await adm.set_version(version)
        step_dropped = 0
        while True:
            while (await adm.snapshot()).capacity > 0:
                made += 1
                await produce(adm, redis, _group(made, version))
            step_dropped += await inbox.drop_stale(version)
            taken = inbox.take_batch()
            if taken is not None:
                break
            await inbox.read()
        batches.append(sorted(g.oldest_version() for g in taken))
        drops.append(step_dropped)
        await inbox.ack_trained()
    snap = await adm.snapshot()
    assert snap.dropped == sum(drops)
    assert snap.accepted == made - sum(drops)  # every drop gave its slot back
    assert snap.accepted == steps * batch + await redis.xlen(NAMES.trajectories)  # nothing leaked
    return batches, drops


def _group(n: int, version: int):
    import numpy as np

    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample
    s = TrajectorySample(0, np.arange(4, dtype=np.int32), np.zeros(4, np.float32),
                         np.full(4, version, np.int32), 1.0, "stop")
    return TrajectoryGroup("job", f"g{n:04d}", "p", np.arange(2, dtype=np.int32), [s], "e", float(n), 0.0)


async def test_fractional_alpha_trains_its_fraction_of_a_batch_at_the_bound(transport_redis):
    """alpha 0.5, B 4 (ROLL's get_batch): after the first step every batch is half from the
    previous version, half from the current one; alpha 1.5 the same, one version further back."""
    half, _ = await run_steps(transport_redis, batch=4, alpha=0.5, steps=4)
    assert half == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]
    await transport_redis.flushdb()
    one_and_a_half, _ = await run_steps(transport_redis, batch=4, alpha=1.5, steps=5)
    assert one_and_a_half == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]


@pytest.mark.parametrize("alpha, batch", [(0.5, 4), (0.5, 5), (1.5, 4), (2.0, 3), (0.0, 3)])
async def test_a_run_of_steps_keeps_to_the_bound(transport_redis, alpha, batch):
    steps = 6
    batches, drops = await run_steps(transport_redis, batch=batch, alpha=alpha, steps=steps)
    policy = StalenessPolicy.per_sample(alpha)
    bound, quota = policy.version_bound, policy.boundary_quota(batch)
    for version, versions in enumerate(batches):
        assert len(versions) == batch
        assert version - min(versions) <= bound
        if quota is not None:
            assert sum(version - v == bound for v in versions) <= quota
    assert any(version - min(versions) == bound for version, versions in enumerate(batches))  # not vacuous
    if (alpha * batch) % 1 == 0:
        assert sum(drops) == 0  # ceil(alpha B) = floor(frac B) + whole batches: nothing is wasted
    else:  # B 5, alpha 0.5: 3 groups ahead, 2 may be trained at the bound: ROLL discards the third
        assert drops == [0] + [1] * (steps - 1)


@pytest.mark.slow
def test_the_trainer_drops_by_alpha_and_reports_it(tmp_path, redis_url):
    """The real trainer (SmolLM2, CPU) under policy per-sample, alpha 0.5, B 2, at version 3: the
    bound is 1 version and of version 2 one group (floor(0.5 x 2)) may be trained."""
    import argparse
    import asyncio
    import json

    import yaml

    from asyncrl.api.loader import load_job
    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.main import build_trainer, connect_io
    from asyncrl.trainer.report.prometheus import TrainerMetrics
    from asyncrl.trainer.report.status_api import status_document
    from asyncrl.trainer.state.checkpoint import TrainerState, lineage_group_ids
    from tests.support.trainer_support import make_groups, publish, redis_query

    name = "t-alpha"
    doc = JobBuilder.small(name, batch_size=2, max_steps=4, checkpoint_interval=10).doc()
    doc["spec"]["staleness"] = {"policy": "per-sample", "asyncRatio": 0.5}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    job = load_job(tmp_path / "job.yaml")
    publish(redis_url, name, make_groups(name, 1, version=0, prefix="old")  # 3 versions old: dropped
            + make_groups(name, 2, version=2, prefix="mid", seed=1)          # at the bound: one stays
            + make_groups(name, 1, version=3, prefix="new", seed=2))
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                      run_dir=tmp_path, pod_name="trainer-0")

    async def go():
        io = await connect_io(job, runtime)
        assert io.admission.staleness == StalenessPolicy.per_sample(0.5)
        assert io.admission.staleness.groups_ahead(io.admission.batch_size) == 1
        assert io.admission.staleness.version_bound == 1
        trainer = build_trainer(job, argparse.Namespace(max_steps=4, no_resume=True), runtime, DistContext(), io)
        trainer.state = TrainerState(step=3, version=3)
        phase = await trainer.run()
        await io.redis.aclose()
        return trainer, phase

    trainer, phase = asyncio.run(go())
    assert phase == "Succeeded" and trainer.state.dropped == 2
    assert lineage_group_ids(tmp_path / "ckpt") == ["mid0000", "new0000"]
    st = trainer.get_report().staleness
    assert (st.policy, st.async_ratio, st.limit, st.dropped) == ("per-sample", 0.5, 1, 2)
    [line] = [json.loads(x) for x in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    assert (line["dropped"], line["dropped_step"]) == (2, 2)
    assert status_document(trainer.get_report())["last_step"]["dropped_step"] == 2
    metrics = TrainerMetrics()
    metrics.update(trainer.get_report())
    for sample, value in (("stale_groups_dropped_total", 2), ("stale_groups_dropped_last_step", 2),
                          ("staleness_async_ratio", 0.5), ("staleness_limit", 1)):
        assert metrics.registry.get_sample_value(f"asyncrl_trainer_{sample}") == value

    async def inspect(r):
        from asyncrl.api.stream_names import StreamNames
        names = StreamNames.for_job(name)
        return ((await r.xpending(names.trajectories, names.consumer_group))["pending"],
                int(await r.hget(names.admission, "dropped") or 0))

    assert redis_query(redis_url, inspect) == (0, 2)  # dropped groups acked and their capacity given back
