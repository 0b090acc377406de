"""Admission accounting cannot leak (issue 15, items 3 and 6), against a real Redis server.

Each test makes one of the leaks seen under faults: a group counted as accepted that exists nowhere
(a write Redis lost), a published group never counted (its release lost), a killed worker's leases.
"""

from __future__ import annotations

import asyncio

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.trainer.inbox import GroupInbox
from asyncrl.transport.admission import Admission
from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer
from tests.support.jobs import JobBuilder
from tests.support.polling import poll

NAMES = StreamNames.for_job("job")


def setup(redis, *, batch: int = 2, eta: int = 0, lease_seconds: float = 30) -> tuple[Admission, GroupInbox]:
    adm = Admission(redis, NAMES, batch_size=batch, staleness=StalenessPolicy.global_budget(eta), max_concurrent=16,
                    lease_seconds=lease_seconds)
    consumer = TrajectoryConsumer(redis, NAMES, "trainer-0")
    return adm, GroupInbox(consumer, adm, batch_size=batch, read_block_ms=50)


async def produce(adm: Admission, redis, group, holder: str = "rollout-0") -> str:
    """What a rollout worker does per group: lease, publish, release as accepted."""
    lease = await adm.try_acquire(holder)
    assert lease is not None, "admission refused a group"
    entry_id = await TrajectoryProducer(redis, NAMES).publish(group)
    await adm.release(lease, accepted=True)
    return entry_id


async def test_a_group_redis_lost_would_deadlock_eta_zero_and_reconciliation_gives_its_slot_back(
        transport_redis, make_trajectory_group):
    adm, inbox = setup(transport_redis, batch=2, eta=0)
    await produce(adm, transport_redis, make_trajectory_group("g0"))
    lost = await produce(adm, transport_redis, make_trajectory_group("g1"))
    await transport_redis.xdel(NAMES.trajectories, lost)  # acknowledged to the producer, then lost
    await inbox.read()
    assert inbox.take_batch() is None  # one group of two: the trainer waits...
    assert (await adm.snapshot()).capacity == 0  # ...and nobody may produce the second: deadlock

    first = await inbox.reconcile()
    assert (first.drift, first.repaired) == (-1, 0)  # seen once: not yet repaired
    second = await inbox.reconcile()
    assert (second.drift, second.repaired) == (-1, -1)
    snap = await adm.snapshot()
    assert (snap.accepted, snap.capacity, snap.drift_lost, snap.drift_found) == (1, 1, 1, 0)

    await produce(adm, transport_redis, make_trajectory_group("g2"))
    await inbox.read()
    batch = inbox.take_batch()
    assert batch is not None and sorted(g.group_id for g in batch) == ["g0", "g2"]
    assert (await inbox.reconcile()).drift == 0


# Leases of LEASE_S: long enough that a loaded machine cannot let one expire between two steps
# that need it live, short enough to wait out where the test needs it expired.
LEASE_S = 2.0


async def test_a_published_group_whose_release_never_landed_is_counted(transport_redis, make_trajectory_group):
    adm, inbox = setup(transport_redis, batch=4, eta=1, lease_seconds=LEASE_S)
    lease = await adm.try_acquire("rollout-0")
    assert lease is not None
    await TrajectoryProducer(transport_redis, NAMES).publish(make_trajectory_group("g0"))
    assert (await inbox.reconcile()).drift == 0  # published, lease live: the release is on its way
    await poll(lambda: _running_is(adm, 0))  # the worker died before its release; the lease expired
    assert [(c.drift, c.repaired) for c in (await inbox.reconcile(), await inbox.reconcile())] == [(1, 0), (1, 1)]
    snap = await adm.snapshot()
    assert (snap.accepted, snap.drift_found, snap.drift_lost) == (1, 1, 0)


async def _running_is(adm: Admission, n: int) -> bool:
    return (await adm.snapshot()).running == n


async def test_a_release_landing_between_two_checks_is_never_repaired(transport_redis, make_trajectory_group):
    adm, inbox = setup(transport_redis, batch=4, eta=1, lease_seconds=LEASE_S)
    lease = await adm.try_acquire("rollout-0")
    assert lease is not None
    await TrajectoryProducer(transport_redis, NAMES).publish(make_trajectory_group("g0"))
    await poll(lambda: _running_is(adm, 0))  # a slow group: its lease expired before the release
    assert (await inbox.reconcile()).drift == 1
    await adm.release(lease, accepted=True)  # a late release still counts the published group
    check = await inbox.reconcile()
    assert (check.drift, check.repaired) == (0, 0)
    snap = await adm.snapshot()
    assert (snap.accepted, snap.drift_found, snap.drift_lost) == (1, 0, 0)


async def test_trained_dropped_and_buffered_groups_are_no_drift(transport_redis, make_trajectory_group):
    adm, inbox = setup(transport_redis, batch=2, eta=1)
    for i in range(4):
        await produce(adm, transport_redis, make_trajectory_group(f"g{i}"))
    await inbox.read()
    await inbox.read()
    assert inbox.take_batch() is not None  # trained, not yet acked: still in the stream
    assert (await inbox.reconcile()).drift == 0
    assert await inbox.ack_trained() == 2 and inbox.trained_acked == 2  # acked: gone from the stream
    assert (await inbox.reconcile()).drift == 0
    assert await inbox.drop_stale(version=5) == 1  # the buffered one is now too stale; one is unread
    assert await transport_redis.xlen(NAMES.trajectories) == 1
    for _ in range(2):
        check = await inbox.reconcile()
        assert (check.drift, check.repaired) == (0, 0)
    assert (await adm.snapshot()).accepted == 3


async def test_a_restarted_worker_returns_its_predecessors_leases_and_no_one_elses(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=100, staleness=StalenessPolicy.global_budget(1),
                    max_concurrent=4,
                    lease_seconds=600)
    dead = [await adm.try_acquire("rollout-1") for _ in range(2)]
    other = await adm.try_acquire("rollout-10")  # a name that only starts with the dead worker's
    assert all(dead) and other and (await adm.snapshot()).capacity == 1
    assert await adm.release_holder("rollout-1") == 2  # the replacement starts under the same name
    snap = await adm.snapshot()
    assert (snap.running, snap.capacity, snap.leases_returned, snap.accepted) == (1, 3, 2, 0)
    assert await adm.renew(other)
    assert not await adm.renew(dead[0])
    await adm.release(dead[0], accepted=True)  # a late release of a returned lease changes nothing
    assert (await adm.snapshot()).accepted == 0
    assert await adm.release_holder("rollout-1") == 0


async def test_a_worker_restarted_under_its_name_starts_at_once_on_its_predecessors_slots(redis_url):
    from asyncrl.transport.connection import connect
    from tests.support.rollout_workers import make_worker
    from tests.support.sglang_fake import FakeSGLang

    redis, fake = await connect(redis_url), FakeSGLang().start()
    names = StreamNames.for_job("wtest")
    try:
        worker = make_worker(redis, fake, names, max_groups=1, max_concurrent=1, engine_id="rollout-3")
        assert await worker.admission.try_acquire("rollout-3")  # the killed predecessor's group (lease 30 s)
        assert (await worker.admission.snapshot()).capacity == 0
        stats = await asyncio.wait_for(worker.run(), 20)  # without the return: no slot for 30 s
        snap = await worker.admission.snapshot()
        assert stats.groups_published == 1 and (snap.accepted, snap.running, snap.leases_returned) == (1, 0, 1)
    finally:
        fake.stop()
        await redis.aclose()


async def test_a_resumed_trainer_counts_what_its_checkpoint_trained_and_reports_admission(
        tmp_path, redis_url, make_trajectory_group):
    """The groups earlier lives trained and acked are gone from the stream: a resumed trainer that
    forgot them would see them as lost and hand their capacity out again (the bound loosened)."""
    import torch

    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.state.checkpoint import TrainerState
    from tests.support.trainer_support import model_and_tokenizer, tiny_model

    job = JobBuilder.small(name="resumed", batch_size=2, eta=0).job()
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c",
                      run_dir=tmp_path, pod_name="trainer-0")
    io = await connect_io(job, runtime)
    names = io.admission.names
    await io.admission.set_version(3)
    await io.redis.hset(names.admission, "accepted", 7)  # 6 trained and acked by earlier lives, 1 in the stream
    await TrajectoryProducer(io.redis, names).publish(make_trajectory_group("g6", job="resumed"))
    _, tok = model_and_tokenizer()
    model = tiny_model()
    cfg = RunConfig(engine_kind="hf", weights_dir=runtime.weights_dir, checkpoint_dir=runtime.checkpoint_dir)
    trainer = Trainer(job, cfg, DistContext(), model, torch.optim.AdamW(model.parameters()), tok, io=io,
                      state=TrainerState(step=3, version=3, groups_trained=6))
    try:
        await trainer.settle_restored()
        for _ in range(2):
            await trainer.check_admission()
        report, recovery = trainer.get_report().admission, trainer.get_report().recovery
        assert (report.accepted, report.drift, recovery.drift_lost, recovery.drift_found) == (7, 0, 0, 0)
        assert report.capacity == 1  # (eta 0, version 3, B 2: 8 allowed, 7 accepted)
    finally:
        await io.redis.aclose()
