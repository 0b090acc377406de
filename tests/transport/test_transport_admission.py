"""Global staleness admission against a real Redis server, including 3 producer processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.admission import LAST_ERROR_CHARS, Admission, admission_capacity
from asyncrl.transport.streams import TrajectoryConsumer
from tests.support.paths import REPO
from tests.support.polling import poll

NAMES = StreamNames.for_job("job")


def test_capacity_rule():
    # AReaL: min(max_concurrent - running, (eta + version + 1) * B - (accepted + running))
    eta_2 = StalenessPolicy.global_budget(2)
    assert admission_capacity(0, 0, 0, batch_size=4, staleness=eta_2, max_concurrent=100) == 12
    assert admission_capacity(1, 10, 2, batch_size=4, staleness=eta_2, max_concurrent=100) == 4
    assert admission_capacity(0, 0, 3, batch_size=4, staleness=eta_2, max_concurrent=3) == 0


async def test_eta_zero_is_synchronous(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=2, staleness=StalenessPolicy.global_budget(0), max_concurrent=10)
    a, b = await adm.try_acquire("pod-a"), await adm.try_acquire("pod-b")
    assert a and b
    assert await adm.try_acquire("pod-a") is None  # B groups of version 0 are running
    assert await adm.release(a, accepted=True) and await adm.release(b, accepted=True)
    assert await adm.try_acquire("pod-a") is None  # nothing more until the trainer steps
    snap = await adm.snapshot()
    assert (snap.version, snap.accepted, snap.running, snap.capacity) == (0, 2, 0, 0)
    await adm.set_version(1)
    c = await adm.try_acquire("pod-a")
    d = await adm.try_acquire("pod-b")
    assert c and d and await adm.try_acquire("pod-c") is None
    await adm.release(c, accepted=False)  # an aborted group frees its slot
    assert await adm.try_acquire("pod-c")


async def test_max_concurrent_limits_running(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=100, staleness=StalenessPolicy.global_budget(4),
                    max_concurrent=2)
    leases = [await adm.try_acquire(f"p{i}") for i in range(3)]
    assert leases[0] and leases[1] and leases[2] is None
    await adm.release(leases[0], accepted=True)
    assert await adm.try_acquire("p3")


async def test_expired_leases_are_released(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=4, staleness=StalenessPolicy.global_budget(0),
                    max_concurrent=1, lease_seconds=0.2)
    # The same job's admission with long leases, for pod-b: its lease must outlive the checks below
    # on a loaded machine (with 0.2 s it expired too, and `running` read 0).
    patient = Admission(transport_redis, NAMES, batch_size=4, staleness=StalenessPolicy.global_budget(0),
                        max_concurrent=1,
                        lease_seconds=60)
    crashed = await adm.try_acquire("crashed-pod")
    assert crashed and await patient.try_acquire("pod-b") is None
    # nobody releases `crashed`: its slot comes back when the lease expires
    lease_b = await poll(lambda: patient.try_acquire("pod-b"))
    snap = await patient.snapshot()
    assert snap.running == 1 and snap.accepted == 0
    assert await adm.renew(crashed) is False
    assert await adm.release(crashed, accepted=False) is False
    assert (await patient.snapshot()).running == 1  # releasing the dead lease did not free pod-b's
    assert await patient.release(lease_b, accepted=True)


async def test_renew_extends_the_lease(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=4, staleness=StalenessPolicy.global_budget(0),
                    max_concurrent=4, lease_seconds=60)
    lease = await adm.try_acquire("pod")
    before = await transport_redis.zscore(NAMES.admission_leases, lease)
    await poll(lambda: _renewed_later(adm, lease, before))  # server clock moved: expiry moved
    assert await adm.release(lease, accepted=False)


async def _renewed_later(adm: Admission, lease: str, before: float) -> bool:
    assert await adm.renew(lease)
    return await adm.redis.zscore(adm.names.admission_leases, lease) > before


async def test_release_is_idempotent_and_dropped_gives_capacity_back(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=2, staleness=StalenessPolicy.global_budget(0), max_concurrent=10)
    a = await adm.try_acquire("p")
    b = await adm.try_acquire("p")
    assert await adm.release(a, accepted=True)
    assert await adm.release(a, accepted=True)  # a retry after a lost reply: no double count
    await adm.release(b, accepted=True)
    assert (await adm.snapshot()).accepted == 2 and await adm.try_acquire("p") is None
    # the trainer dropped one of them as too stale: one more group may be produced
    assert await adm.record_dropped(1) == 1
    snap = await adm.snapshot()
    assert snap.capacity == 1 and snap.dropped == 1
    assert await adm.try_acquire("p") and await adm.try_acquire("p") is None


async def test_a_group_not_published_is_counted_with_its_newest_error_and_gives_its_slot_back(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=1, staleness=StalenessPolicy.global_budget(0), max_concurrent=10)
    assert (await adm.snapshot()).last_errors == {}
    for i, cause in enumerate(("reward_failures", "episode_failures", "episode_failures", "engine_requeues")):
        lease = await adm.try_acquire("p")
        assert await adm.try_acquire("p") is None  # eta 0, B 1: one group per version
        await adm.record_failure(cause, f"error {i}" + "x" * 1000)
        await adm.release(lease, accepted=False)
    snap = await adm.snapshot()
    assert (snap.accepted, snap.running, snap.capacity) == (0, 0, 1)
    assert (snap.reward_failures, snap.episode_failures, snap.generation_failures, snap.engine_requeues) == (1, 2, 0, 1)
    assert {c: e[:7] for c, e in snap.last_errors.items()} == \
        {"reward_failures": "error 0", "episode_failures": "error 2", "engine_requeues": "error 3"}
    assert all(len(e) == LAST_ERROR_CHARS for e in snap.last_errors.values())
    assert await adm.try_acquire("p")
    with pytest.raises(ValueError, match="unknown failure cause 'rewards'; one of reward_failures, "):
        await adm.record_failure("rewards", "x")  # type: ignore[arg-type]


async def test_a_group_dropped_before_its_lease_is_released_is_not_counted_twice(transport_redis):
    # A producer XADDs, then releases its lease (accepted + 1). The trainer may read and drop the
    # group in between, at job start while accepted is still 0: the give-back must not be lost.
    adm = Admission(transport_redis, NAMES, batch_size=2, staleness=StalenessPolicy.global_budget(0), max_concurrent=10)
    lease = await adm.try_acquire("p")
    assert await adm.record_dropped(1) == -1  # (published, dropped, not yet released)
    await adm.release(lease, accepted=True)
    snap = await adm.snapshot()
    assert (snap.accepted, snap.running, snap.capacity, snap.dropped) == (0, 0, 2, 1)
    # without a live lease to explain it, accepted stays at 0
    assert await adm.record_dropped(1) == 0


def test_too_stale_uses_the_oldest_token(make_trajectory_group):
    g = make_trajectory_group("g", version=5)
    g.samples[1].versions[0] = 3  # one token from an older policy (partial rollout)
    assert g.oldest_version() == 3
    assert StalenessPolicy.global_budget(1).too_stale(g.oldest_version(), 5)  # 5 - 3 = 2 > 1
    assert not StalenessPolicy.global_budget(2).too_stale(g.oldest_version(), 5)
    assert StalenessPolicy.global_budget(2).too_stale(g.oldest_version(), 6)
    assert StalenessPolicy.per_sample(1.5).too_stale(g.oldest_version(), 6)  # bound ceil(1.5) = 2
    empty = make_trajectory_group("e", n_tokens=0)
    assert not StalenessPolicy.global_budget(0).too_stale(empty.oldest_version(), 100)


PRODUCER_SCRIPT = r"""
import asyncio, random, sys
import numpy as np
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.transport.streams import TrajectoryProducer
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

async def main(url, holder, events, stop, ratio=""):
    r = await connect(url)
    names = StreamNames.for_job("job")
    # per-sample policy (ROLL's alpha), else eta = 2
    policy = StalenessPolicy.per_sample(float(ratio)) if ratio else StalenessPolicy.global_budget(2)
    adm = Admission(r, names, batch_size=4, staleness=policy, max_concurrent=6)
    producer = TrajectoryProducer(r, names)
    rng = random.Random(holder)
    n = 0
    while not await r.exists(stop):
        lease = await adm.try_acquire(holder)
        if lease is None:
            await asyncio.sleep(0.002)
            continue
        # recorded after the grant and before the release: the record never overstates
        await r.xadd(events, {"type": "acquire", "lease": lease})
        version = (await adm.snapshot()).version
        await asyncio.sleep(rng.uniform(0, 0.005))  # "generation"
        accepted = rng.random() < 0.8
        if accepted:
            n += 1
            s = TrajectorySample(0, np.arange(4, dtype=np.int32), np.zeros(4, np.float32),
                                 np.full(4, version, np.int32), 1.0, "stop")
            await producer.publish(TrajectoryGroup("job", f"{holder}-{n}", "p", np.arange(2, dtype=np.int32),
                                                   [s], holder, 0.0, 0.0))
        await r.xadd(events, {"type": "release", "lease": lease, "accepted": int(accepted)})
        await adm.release(lease, accepted=accepted)
    await r.aclose()

asyncio.run(main(*sys.argv[1:6]))
"""


def check_records(events: list, *, eta: int, batch_size: int, max_concurrent: int,
                  ahead: int | None = None) -> dict[int, int]:
    """Replay the append-only record; assert the bound at every entry. Returns peak per version.
    `ahead`: the groups admitted beyond the version's batch (default eta * B)."""
    ahead = eta * batch_size if ahead is None else ahead
    version, accepted, dropped, running = 0, 0, 0, set()
    peaks: dict[int, int] = {0: 0}
    for _, f in events:
        kind = f[b"type"]
        if kind == b"acquire":
            running.add(f[b"lease"])
        elif kind == b"release":
            running.discard(f[b"lease"])
            accepted += int(f[b"accepted"])
        elif kind == b"version":
            version = int(f[b"v"])
            peaks.setdefault(version, 0)
        elif kind == b"dropped":
            dropped += int(f[b"n"])
        total = accepted - dropped + len(running)
        bound = (version + 1) * batch_size + ahead
        assert total <= bound, f"accepted+running {total} > {bound} at version {version}"
        assert len(running) <= max_concurrent
        peaks[version] = max(peaks[version], total)
    return peaks


@pytest.mark.slow
async def test_three_producer_processes_never_exceed_the_bound(transport_redis, redis_url):
    eta, batch, versions = 2, 4, 6
    adm = Admission(transport_redis, NAMES, batch_size=batch, staleness=StalenessPolicy.global_budget(eta),
                    max_concurrent=6)
    events = await run_three_producers(transport_redis, redis_url, adm, versions=versions)
    peaks = check_records(events, eta=eta, batch_size=batch, max_concurrent=6)
    # not vacuous: the producers filled the bound at every version the trainer saw saturated
    for v in range(versions):
        assert peaks[v] == (eta + v + 1) * batch


async def run_three_producers(r, redis_url: str, adm: Admission, *, versions: int, ratio: str = "") -> list:
    """Three PRODUCER_SCRIPT processes (`ratio`: their asyncRatio, "" for eta 2) against a trainer
    that waits for saturation at each version, then takes a batch (at version 2 after dropping one
    group as too stale). Returns the append-only record of grants, releases, drops and versions."""
    batch = adm.batch_size
    events, stop = "test:{job}:events", "test:{job}:stop"
    consumer = TrajectoryConsumer(r, NAMES, "trainer")
    procs = [subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, redis_url, f"pod{i}", events, stop, ratio],
                              cwd=REPO / "tests", stderr=subprocess.PIPE) for i in range(3)]
    try:
        for v in range(versions):
            # let the producers saturate: full bound reached and every lease settled
            async def saturated():
                snap = await adm.snapshot()
                return snap.capacity == 0 and snap.running == 0
            await poll(saturated, timeout=60)
            for p in procs:
                assert p.poll() is None, p.stderr.read().decode()
            need, batch_groups = batch, []
            if v == 2:  # drop one group as too stale; record first, then give capacity back
                [victim] = await consumer.read(1, 1000)
                await r.xadd(events, {"type": "dropped", "n": 1})
                await adm.record_dropped(1)
                await consumer.ack([victim])
                await poll(saturated, timeout=60)
            while need:
                got = await consumer.read(need, 1000)
                batch_groups += got
                need -= len(got)
            await consumer.ack(batch_groups)
            # record the new version before it takes effect: the record never understates the bound
            await r.xadd(events, {"type": "version", "v": v + 1})
            await adm.set_version(v + 1)
        await r.set(stop, 1)
        for p in procs:
            assert p.wait(30) == 0, p.stderr.read().decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
    return await r.xrange(events)


# --- the per-sample policy (ROLL Flash's asynchronous ratio alpha, issue 20) -----------------

def test_capacity_rule_per_sample():
    # ROLL: ceil(alpha * B) groups ahead of (version + 1) * B; eta is not used
    def cap(version: int, accepted: int, running: int, alpha: float, b: int = 4) -> int:
        return admission_capacity(version, accepted, running, batch_size=b,
                                  staleness=StalenessPolicy("per-sample", eta=7, alpha=alpha), max_concurrent=100)
    assert cap(0, 0, 0, 0.5) == 6      # half a batch ahead
    assert cap(0, 0, 0, 1.5) == 10
    assert cap(0, 0, 0, 0.0) == 4      # synchronous
    assert cap(2, 10, 1, 0.5) == 3     # 3 * 4 + 2 - (10 + 1)
    assert cap(0, 0, 0, 0.1, b=30) == 33  # the decimal 0.1, not the float: ceil(3.0000000000000004) would be 4
    assert cap(1, 8, 0, 1.0) == admission_capacity(1, 8, 0, batch_size=4, staleness=StalenessPolicy.global_budget(1),
                                                   max_concurrent=100)  # integer alpha = eta


async def test_fractional_alpha_admits_half_a_batch_ahead(transport_redis):
    adm = Admission(transport_redis, NAMES, batch_size=4, staleness=StalenessPolicy.per_sample(0.5), max_concurrent=100)
    assert adm.staleness.version_bound == 1  # the version bound a producer checks: ceil(0.5)
    leases = [await adm.try_acquire("pod") for _ in range(7)]
    assert all(leases[:6]) and leases[6] is None  # B + ceil(0.5 * 4) = 6 of version 0
    for lease in leases[:6]:
        await adm.release(lease, accepted=True)
    await adm.set_version(1)
    more = [await adm.try_acquire("pod") for _ in range(5)]
    assert all(more[:4]) and more[4] is None  # the next version admits one batch more


@pytest.mark.slow
@pytest.mark.parametrize("ratio, ahead", [("1.5", 6), ("0.5", 2), ("1", 4)])
async def test_three_producer_processes_keep_to_the_per_sample_bound(transport_redis, redis_url, ratio, ahead):
    batch, versions = 4, 4
    adm = Admission(transport_redis, NAMES, batch_size=batch, staleness=StalenessPolicy.per_sample(float(ratio)),
                    max_concurrent=6)
    events = await run_three_producers(transport_redis, redis_url, adm, versions=versions, ratio=ratio)
    peaks = check_records(events, eta=0, batch_size=batch, max_concurrent=6, ahead=ahead)
    for v in range(versions):  # not vacuous: filled to exactly the bound at every version
        assert peaks[v] == (v + 1) * batch + ahead
