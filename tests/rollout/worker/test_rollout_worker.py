"""The rollout worker against the fake SGLang server and a real Redis server."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.prompt_cursor import cursor_key
from asyncrl.trainer.weights.engine_update import catch_up, update_engines
from asyncrl.transport.streams import read_dead_letters
from asyncrl.transport.versions import EngineRegistry, VersionChannel, VersionEvent
from asyncrl.transport.wire import decode_group
from tests.support.polling import poll
from tests.support.rollout_workers import JOB, make_worker, published
from tests.support.sglang_fake import fake_logprob, fake_token


async def test_publishes_whole_scored_groups(rollout_env):
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=3, max_new=5, max_groups=3)
    stats = await asyncio.wait_for(worker.run(), 60)
    groups = await published(redis, names)
    assert stats.groups_published == 3 and len(groups) == 3
    assert sorted(g.prompt_id for g in groups) == [f"arith-0-1-{i}" for i in range(3)]
    for g in groups:
        prompt = list(g.prompt_ids)
        assert len(g.samples) == 3 and g.engine_id == "pod-0" and g.job == JOB
        for s in g.samples:
            assert list(s.response_ids) == [fake_token(prompt, i) for i in range(5)]
            assert list(s.versions) == [0] * 5 and s.finish_reason == "length"
            assert s.reward in (0.0, 1.0)
    snap = await worker.admission.snapshot()
    assert snap.running == 0 and snap.accepted == 3
    assert await redis.get(cursor_key(names, 0, 1)) == b"3"


async def test_partial_rollout_across_a_weight_update(rollout_env):
    """One trajectory whose versions change exactly at the resume point; tokens/logprobs concatenate.
    The trainer-side sync updates the engine; the worker only re-sends the aborted segment."""
    redis, fake, names = rollout_env
    fake.state.token_delay = 0.02
    worker = make_worker(redis, fake, names, n=1, max_new=40, max_groups=1)
    run = asyncio.create_task(worker.run())
    registry = EngineRegistry(redis, names)

    async def progressed():
        return fake.state.tokens_generated >= 5 and len(await registry.list()) == 1

    await poll(progressed, what="first tokens")
    await VersionChannel(redis, names).publish(VersionEvent(version=1, weights_path="/weights/v1", time=time.time()))
    await update_engines("sglang", await registry.list(), Path("/weights/v1"), 1, registry=registry, timeout_s=10)
    await asyncio.wait_for(run, 60)
    [group] = await published(redis, names)
    [sample] = group.samples
    prompt = list(group.prompt_ids)
    ids, versions, lps = list(sample.response_ids), list(sample.versions), list(sample.behav_logprobs)
    assert len(ids) == 40 and sample.finish_reason == "length"
    k = versions.index(1)
    assert 0 < k < 40 and versions == [0] * k + [1] * (40 - k)
    assert ids[:k] == [fake_token(prompt, i) for i in range(k)]
    assert ids[k:] == [fake_token(prompt + ids[:k], j) for j in range(40 - k)]
    assert lps == pytest.approx([fake_logprob(i, "default") for i in range(k)] +
                                [fake_logprob(j, "1") for j in range(40 - k)], abs=1e-6)
    resend = fake.state.generate_calls[-1]
    assert resend == {"input_ids": prompt + ids[:k], "max_new_tokens": 40 - k}
    assert fake.state.control_calls == ["pause:abort", "update:1", "continue"]
    assert fake.state.update_calls[-1]["model_path"] == "/weights/v1"
    assert worker.stats.interrupted == 1 and worker.version == 1


async def test_admission_blocks_the_worker_under_a_slow_trainer(rollout_env):
    redis, fake, names = rollout_env
    # B=1, eta=0: one group may be accepted per trainer version.
    worker = make_worker(redis, fake, names, n=2, batch=1, eta=0, max_concurrent=4)
    run = asyncio.create_task(worker.run())

    async def count():
        return len(await redis.xrange(names.trajectories))

    await poll(lambda: _ge(count, 1), what="first group")
    # The worker is now blocked in acquire: no capacity, nothing running, nothing buffered.
    assert await worker.admission.try_acquire("probe") is None
    snap = await worker.admission.snapshot()
    assert (snap.accepted, snap.running, snap.capacity) == (1, 0, 0)
    requests_before = fake.state.requests
    await asyncio.sleep(0.3)  # an observation window, not a synchronisation
    assert await count() == 1 and fake.state.requests == requests_before == 2
    await worker.admission.set_version(1)  # the trainer finished a step
    await poll(lambda: _ge(count, 2), what="second group")
    worker.stop()
    await asyncio.wait_for(run, 30)
    assert await count() == 2


async def _ge(fn, n):
    return await fn() >= n


async def test_engine_errors_are_retried_then_the_group_is_dropped(rollout_env):
    redis, fake, names = rollout_env
    fake.state.fail_next = 1
    worker = make_worker(redis, fake, names, n=1, max_groups=1, max_retries=2)
    stats = await asyncio.wait_for(worker.run(), 30)
    assert stats.groups_published == 1 and stats.request_errors == 1

    await redis.delete(*names.all_keys(), cursor_key(names, 0, 1))
    fake.state.fail_next = 1000
    worker = make_worker(redis, fake, names, n=2, max_groups=1, max_retries=2)
    stats = await asyncio.wait_for(worker.run(), 30)
    assert stats.groups_published == 0 and stats.groups_dropped == 1
    assert 3 <= stats.request_errors <= 6  # each sample: 1 try + 2 retries (the other may be cut short)
    snap = await worker.admission.snapshot()
    assert snap.running == 0 and snap.accepted == 0 and snap.generation_failures == 1
    assert snap.last_errors["generation_failures"].startswith("prompt ")  # (what a stalled job quotes)
    assert "engine failed 3 time(s)" in snap.last_errors["generation_failures"]
    assert await redis.xlen(names.trajectories) == 0


class NaNLogprobEngine(SGLangEngine):
    """The fake's answers with the last token's logprob NaN (what vLLM's adapter makes of a missing one)."""

    async def generate(self, input_ids, params):
        result = await super().generate(input_ids, params)
        result.logprobs[-1] = float("nan")
        return result


async def test_untrainable_groups_are_dropped_not_published(rollout_env, caplog):
    """Issue 16: a group the trainer could not train is never published; it is dropped like a group
    whose generation failed (counted, logged with the reason, lease released unaccepted, prompt
    passed over), so it can neither crash the trainer nor hold an admission slot."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=2, max_groups=2, engine=NaNLogprobEngine(fake.url))
    with caplog.at_level("WARNING", logger="asyncrl.rollout.worker"):
        stats = await asyncio.wait_for(worker.run(), 30)
    assert stats.groups_published == 0 and stats.groups_dropped == stats.groups_invalid == 2
    assert await redis.xlen(names.trajectories) == 0
    snap = await worker.admission.snapshot()
    assert snap.running == 0 and snap.accepted == 0 and snap.generation_failures == 2
    assert "behav_logprobs[5] is NaN" in snap.last_errors["generation_failures"]
    assert await redis.get(cursor_key(names, 0, 1)) == b"2"
    assert "not published" in caplog.text and "behav_logprobs[5] is NaN" in caplog.text
    assert "invalid=2" in worker.summary()


async def test_a_group_whose_reward_fails_is_dead_lettered_never_published(rollout_env, caplog):
    """An infrastructure failure is never a zero reward: with reward.onError drop, a group with a
    sample whose reward failed past its retries is not published (lease released unaccepted, prompt
    passed over), is dead-lettered with the reason, and is counted job-wide in admission."""
    redis, fake, names = rollout_env
    calls: dict[str, int] = {}

    def verifier(completion: str, answer: str) -> float:  # down for even answers, on every try
        calls[answer] = calls.get(answer, 0) + 1
        if int(answer) % 2 == 0:
            raise RuntimeError("verifier down")
        return exact_number_reward(completion, answer)

    scorer = RewardScorer(verifier, 5.0, name="verifier", retries=1, on_error="drop")
    worker = make_worker(redis, fake, names, n=2, max_groups=6, scorer=scorer)
    with caplog.at_level("WARNING", logger="asyncrl.rollout.worker"):
        stats = await asyncio.wait_for(worker.run(), 30)
    items = [worker.prompts.pick(i)[1] for i in range(6)]
    answers = {item.prompt_id: item.answer for item in items}
    failing = sorted(p for p, a in answers.items() if int(a) % 2 == 0)
    assert 0 < len(failing) < 6, answers  # (the seed gives both kinds)
    groups = await published(redis, names)
    assert sorted(g.prompt_id for g in groups) == sorted(set(answers) - set(failing))
    assert all(math.isfinite(s.reward) for g in groups for s in g.samples)
    assert stats.groups_dropped == stats.groups_unscored == len(failing)
    assert all(calls[answers[p]] == 2 * 2 for p in failing)  # 2 samples x (1 try + 1 retry)
    letters = await read_dead_letters(redis, names)
    assert sorted(decode_group(d.payload).prompt_id for d in letters) == failing
    for letter in letters:
        assert letter.error.startswith("reward failed: 2 of 2 rewards failed: reward 'verifier' failed (2 tries)")
        assert letter.error.endswith("RuntimeError: verifier down") and letter.consumer == "pod-0"
        assert all(math.isnan(s.reward) for s in decode_group(letter.payload).samples)
    snap = await worker.admission.snapshot()
    assert (snap.running, snap.accepted, snap.reward_failures) == (0, 6 - len(failing), len(failing))
    assert snap.last_errors["reward_failures"].endswith("RuntimeError: verifier down")
    assert await redis.get(cursor_key(names, 0, 1)) == b"6"
    assert f"unscored={len(failing)}" in worker.summary() and "verifier down" in caplog.text


async def test_stop_releases_in_flight_groups_and_unregisters(rollout_env):
    redis, fake, names = rollout_env
    fake.state.token_delay = 0.05
    worker = make_worker(redis, fake, names, n=2, max_new=500)
    run = asyncio.create_task(worker.run())
    registry = EngineRegistry(redis, names)

    async def busy():
        return fake.state.running >= 2 and len(await registry.list()) == 1

    await poll(busy, what="requests in flight and the engine registered")
    [info] = await registry.list()
    assert info.engine_id == "pod-0" and info.url == fake.url and info.ready
    assert (await worker.admission.snapshot()).running >= 1
    worker.stop()
    stats = await asyncio.wait_for(run, 30)
    snap = await worker.admission.snapshot()
    assert snap.running == 0 and snap.accepted == 0 and stats.groups_published == 0
    assert await registry.list() == []
    assert await redis.get(cursor_key(names, 0, 1)) == b"0"  # unfinished prompts are redone after restart
    stopper = SGLangEngine(fake.url)  # end the fake's orphaned generations so it shuts down at once
    await stopper.pause("abort")
    await stopper.close()


async def test_a_group_stopped_before_its_task_ever_ran_gives_its_lease_back(rollout_env):
    """The race behind a flaky stop: a lease granted just as stop() lands starts a group task that is
    cancelled before its first step, so its own `finally` never runs; the shutdown releases it."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=2)
    await worker.cursor.restore()
    lease = await worker.admission.acquire("pod-0")
    worker._start(lease, *await worker.cursor.take())  # no await between this and the cancellation below
    worker.stop()
    await worker._shut_down([])
    snap = await worker.admission.snapshot()
    assert (snap.running, snap.accepted) == (0, 0)
    assert await redis.get(cursor_key(names, 0, 1)) == b"0"  # its prompt is redone after a restart


async def test_shards_are_disjoint_and_the_cursor_resumes(rollout_env):
    redis, fake, names = rollout_env
    w = make_worker(redis, fake, names, n=1, max_new=2, max_groups=2, index=1, replicas=2, engine_id="pod-1")
    await asyncio.wait_for(w.run(), 30)
    w = make_worker(redis, fake, names, n=1, max_new=2, max_groups=2, index=1, replicas=2, engine_id="pod-1")
    await asyncio.wait_for(w.run(), 30)
    w0 = make_worker(redis, fake, names, n=1, max_new=2, max_groups=2, index=0, replicas=2, engine_id="pod-0")
    await asyncio.wait_for(w0.run(), 30)
    by_engine: dict[str, list[str]] = {}
    for g in await published(redis, names):
        by_engine.setdefault(g.engine_id, []).append(g.prompt_id)
    assert sorted(by_engine["pod-1"]) == [f"arith-0-1-{p}" for p in (1, 3, 5, 7)]
    assert sorted(by_engine["pod-0"]) == [f"arith-0-1-{p}" for p in (0, 2)]


async def test_shared_cursor_hands_each_prompt_to_exactly_one_of_concurrent_workers(rollout_env):
    """rolloutReplicas 0 (a Kubernetes Deployment: no pod index): one job-wide atomic cursor."""
    redis, fake, names = rollout_env
    workers = [make_worker(redis, fake, names, n=1, max_new=2, max_groups=3, index=0, replicas=0,
                           engine_id=f"pod-{i}", batch=8) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 30)
    again = make_worker(redis, fake, names, n=1, max_new=2, max_groups=2, replicas=0, engine_id="pod-2", batch=8)
    await asyncio.wait_for(again.run(), 30)  # a restarted pod continues after the others
    prompts = [g.prompt_id for g in await published(redis, names)]
    assert sorted(prompts) == sorted(f"arith-0-1-{p}" for p in range(8))
    assert await redis.get(cursor_key(names, 0, 0)) == b"8"


@pytest.mark.parametrize("engine_label", ["3", "default"])
async def test_worker_never_updates_its_engine_and_tags_what_the_engine_serves(rollout_env, engine_label, tmp_path):
    """A version event is only observed: tokens carry the engine's label. An engine the trainer
    has not updated yet serves its launch weights ("default": version 0); at policy version 3
    and eta 1 those are beyond the admission bound, so the worker generates nothing on them and
    waits for the trainer's catch-up (trainer/weights/engine_update.py) to load version 3."""
    redis, fake, names = rollout_env
    fake.state.weight_version = engine_label
    await VersionChannel(redis, names).publish(VersionEvent(version=3, weights_path="/w/v3", time=time.time()))
    worker = make_worker(redis, fake, names, n=1, max_new=3, max_groups=1)
    run = asyncio.create_task(worker.run())
    if engine_label == "default":
        registry = EngineRegistry(redis, names)

        async def waiting():
            return worker.stats.weight_waits >= 1 and [e.label for e in await registry.list()] == ["default"]

        await poll(waiting, what="the worker waiting for current weights")
        assert fake.state.generate_calls == [] and worker.health.is_failing("engine-weights", fake.url)
        (tmp_path / "v3").mkdir()
        assert await catch_up("sglang", registry, tmp_path / "v3", 3, timeout_s=10) == [fake.url]
    await asyncio.wait_for(run, 30)
    [group] = await published(redis, names)
    assert list(group.samples[0].versions) == [3] * 3
    assert worker.version == 3 and worker.engine_version == 3
    assert not worker.health.is_failing("engine-weights", fake.url)
    if engine_label == "3":
        assert fake.state.control_calls == [] and fake.state.update_calls == []


async def test_a_long_answer_is_generated_in_segments_that_continue_each_other(rollout_env):
    """spec.rollout.maxTokensPerRequest: 40 tokens asked 16 at a time make one answer of 40, each
    request continuing the last (prompt + the tokens so far), the last one ending it at the budget."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=1, max_new=40, max_groups=1)
    worker.cfg.max_tokens_per_request = 16
    stats = await asyncio.wait_for(worker.run(), 60)
    [group] = await published(redis, names)
    [sample] = group.samples
    prompt, ids = list(group.prompt_ids), list(sample.response_ids)
    assert len(ids) == 40 and sample.finish_reason == "length" and stats.segments == 2
    assert [c["max_new_tokens"] for c in fake.state.generate_calls] == [16, 16, 8]
    assert [c["input_ids"] for c in fake.state.generate_calls] == [prompt, prompt + ids[:16], prompt + ids[:32]]
    for start in (0, 16, 32):
        assert ids[start:start + 16] == [fake_token(prompt + ids[:start], j) for j in range(len(ids[start:start + 16]))]
    assert list(sample.behav_logprobs) == pytest.approx([fake_logprob(j, "default") for j in range(16)] * 2
                                                        + [fake_logprob(j, "default") for j in range(8)], abs=1e-6)


async def test_cursor_saves_never_go_back(rollout_env):
    """Completions close together start several saves; on separate connections an older value could
    land last (seen in CI: the shard cursor read 1 after 3 groups). A SET that takes longer the
    smaller its value provokes exactly that: the saved cursor must still end at the newest."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, index=0, replicas=2)

    class SlowOldValues:
        def __init__(self, inner):
            self.inner = inner

        async def set(self, key, value):
            await asyncio.sleep(0.05 * (3 - int(value)))
            return await self.inner.set(key, value)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    worker.cursor.redis = SlowOldValues(redis)
    for local in range(3):
        worker.cursor.mark_done(local)
        await asyncio.sleep(0)  # each save starts before the next completion
    await worker.cursor.save()  # the final save at shutdown, while the older ones are in flight
    await worker.cursor.saved()
    assert await redis.get(cursor_key(names, 0, 2)) == b"3"


class _RenewalCancelledInsideACommand:
    """Admission whose renew is cancelled inside its Redis command, which (as redis-py does) closes
    the connection and raises a connection error instead of the CancelledError."""

    lease_ms = 150

    def __init__(self) -> None:
        self.calls = 0

    async def renew(self, lease: str) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.calls += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed while reading") from None


async def test_a_side_task_cancelled_inside_a_redis_command_still_ends(rollout_env):
    """Found by CI hanging at a module's event-loop shutdown: a periodic side task (lease renewal,
    the evaluation's touch, a heartbeat) logs and retries Redis errors; a cancellation turned into
    one was spent, and the task outlived its owner's cancel() for good."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=1)
    worker.admission = admission = _RenewalCancelledInsideACommand()
    task = asyncio.create_task(worker._renew("lease-1"))
    await poll(lambda: admission.calls == 1, what="the renewal inside its command")
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    assert task in done and task.cancelled() and admission.calls == 1
