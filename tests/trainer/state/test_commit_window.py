"""The commit window: a trainer killed at any instant of `Trainer.commit` (checkpoint, then ack)
trains every group exactly once in the surviving lineage, against a real Redis.

The trainer runs on a tiny copy of SmolLM2's architecture (same tokenizer and vocabulary, one
32-wide layer) so a step and a checkpoint take milliseconds; a "kill" is an exception no handler
catches, raised at the chosen instant, after which everything of that life is thrown away and a new
trainer resumes from the newest checkpoint, exactly as a restarted pod would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.transport.streams import trained_ids
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import chat_groups, model_and_tokenizer, publish, redis_query, tiny_model

JOB = "t-window"
BATCH, INTERVAL, STEPS = 2, 2, 4


class SimulatedKill(BaseException):
    """A SIGKILL at this instant: nothing after it in this life runs (BaseException: no handler)."""






def _runtime(tmp_path: Path, redis_url: str) -> Any:
    from asyncrl.api.runtime import Runtime

    return Runtime(redis_url=redis_url, weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                   run_dir=tmp_path, pod_name="trainer-0")


def _trainer(tmp_path: Path, job: Any, io: Any) -> Any:
    """What `trainer.main.build_trainer` does, on the tiny model: resume from the newest checkpoint."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.state.checkpoint import latest_checkpoint, load_checkpoint

    _, tok = model_and_tokenizer()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = RunConfig(engine_kind="hf", weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                    metrics_path=tmp_path / "metrics.jsonl", read_block_ms=50)
    ckpt = latest_checkpoint(cfg.checkpoint_dir)
    state = load_checkpoint(ckpt, model, opt) if ckpt is not None else None
    return Trainer(job, cfg, DistContext(), model, opt, tok, io=io, state=state)


def _redis_trained(redis_url: str) -> tuple[set[str], int]:
    from asyncrl.api.stream_names import StreamNames

    names = StreamNames.for_job(JOB)

    async def q(r: Any) -> tuple[set[str], int]:
        trained = await trained_ids(r, names)
        return trained, (await r.xpending(names.trajectories, names.consumer_group))["pending"]

    return redis_query(redis_url, q)


def _newest_state(root: Path) -> Any:
    from asyncrl.trainer.state.checkpoint import latest_checkpoint, read_state

    latest = latest_checkpoint(root)
    return read_state(latest) if latest is not None else None


def _arm(trainer: Any, kill_at: str, kill_step: int) -> None:
    """Raise SimulatedKill at `kill_at` of the commit of step `kill_step`."""
    import asyncrl.trainer.loop as loop

    real_save, real_ack = loop.save_checkpoint, trainer.inbox.ack_trained

    def kill(where: str, step: int) -> None:
        if where == kill_at and step == kill_step:
            loop.save_checkpoint = real_save  # (one kill: the next life runs the real code)
            raise SimulatedKill

    def save(root: Path, model: Any, optimizer: Any, state: Any, **kw: Any) -> Path:
        kill("before-rename", state.step)
        return real_save(root, model, optimizer, state, **kw)

    async def ack() -> int:
        kill("after-rename", trainer.state.step)
        count = await real_ack()
        kill("after-ack", trainer.state.step)
        return count

    loop.save_checkpoint = save  # (the test's monkeypatch restores the module at its end)
    trainer.inbox.ack_trained = ack


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["before-rename", "after-rename", "after-ack"])
def test_killed_anywhere_in_the_commit_window_trains_each_group_exactly_once(
        kill_at: str, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncrl.trainer.loop as loop
    from asyncrl.trainer.main import connect_io

    monkeypatch.setattr(loop, "save_checkpoint", loop.save_checkpoint)  # _arm replaces it
    job = JobBuilder.small(name=JOB, batch_size=BATCH, max_steps=STEPS, checkpoint_interval=INTERVAL, eta=10).job()
    groups = chat_groups(JOB, BATCH * STEPS)
    all_ids = {g.group_id for g in groups}
    publish(redis_url, JOB, groups)
    runtime = _runtime(tmp_path, redis_url)
    lineage: dict[int, list[str]] = {}  # step -> the groups that step trained, in the surviving timeline

    async def life(kill: bool) -> Any:
        io = await connect_io(job, runtime)
        try:
            trainer = _trainer(tmp_path, job, io)
            for step in [s for s in lineage if s > trainer.state.step]:
                del lineage[step]  # trained in a timeline the restart lost (after its checkpoint)
            train_step = trainer.train_step

            def recorded(batch: list[Any], replayed: Any = None) -> Any:
                lineage[trainer.state.step + 1] = [g.group_id for g in batch]
                return train_step(batch, replayed)

            trainer.train_step = recorded
            if kill:
                _arm(trainer, kill_at, INTERVAL)
            return trainer, await trainer.run()
        finally:
            await io.redis.aclose()

    with pytest.raises(SimulatedKill):
        asyncio.run(life(kill=True))
    # At the kill, Redis and the newest checkpoint agree: (a) every group Redis says is trained is
    # in the checkpoint's lineage (nothing acknowledged is lost), (b) every group of that lineage
    # Redis does not mark trained is in the checkpoint's window (what the resume acknowledges).
    trained, _ = _redis_trained(redis_url)
    state = _newest_state(tmp_path / "ckpt")
    newest = state.step if state is not None else 0
    assert newest == (0 if kill_at == "before-rename" else INTERVAL)
    lineage_at_kill = {g for s in range(1, newest + 1) for g in lineage[s]}
    assert trained <= lineage_at_kill
    window = set(state.window_group_ids) if state is not None else set()
    assert lineage_at_kill - trained <= window
    assert bool(lineage_at_kill - trained) == (kill_at == "after-rename")  # the window the bug retrained

    trainer, phase = asyncio.run(life(kill=False))
    assert phase == "Succeeded" and trainer.state.step == STEPS

    trained_ids = [g for s in sorted(lineage) for g in lineage[s]]
    assert sorted(lineage) == list(range(1, STEPS + 1))
    assert len(trained_ids) == len(set(trained_ids)), f"trained twice: {trained_ids}"
    assert set(trained_ids) == all_ids
    trained, pending = _redis_trained(redis_url)
    assert trained == all_ids and pending == 0
    # The resume acknowledged the window's pending entries instead of training them.
    assert trainer.io.consumer.stats.acked_committed == (BATCH * INTERVAL if kill_at == "after-rename" else 0)
    assert trainer.io.consumer.stats.acked_already_trained == 0
    # The lineage log says the same as what train_step saw (lost-timeline lines were cut off),
    # and state.json holds one window, not the lineage.
    from asyncrl.trainer.state.checkpoint import TRAINED_LOG, lineage_group_ids

    assert lineage_group_ids(tmp_path / "ckpt") == trained_ids
    assert len((tmp_path / "ckpt" / TRAINED_LOG).read_text().splitlines()) == STEPS // INTERVAL  # one per checkpoint
    final = _newest_state(tmp_path / "ckpt")
    assert final is not None and (final.step, final.groups_trained) == (STEPS, BATCH * STEPS)
    assert (final.window_start_step, final.window_group_ids) == (STEPS - INTERVAL, trained_ids[-BATCH * INTERVAL:])


# ---------------------------------------------------------------- the consumer side (no model)


def _names() -> Any:
    from asyncrl.api.stream_names import StreamNames

    return StreamNames.for_job("job")


async def test_ack_committed_acks_the_restored_window_and_marks_it_trained(transport_redis, make_trajectory_group):
    """A restart after checkpoint-then-kill: the window's pending entries are acked (through the ack
    script), the window's ids are trained wherever their entries are, the rest is untouched."""
    from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

    r, names = transport_redis, _names()
    producer = TrajectoryProducer(r, names)
    for gid in ("w1", "w2", "x"):
        await producer.publish(make_trajectory_group(gid))
    killed = TrajectoryConsumer(r, names, "trainer-0")
    assert [d.group.group_id for d in await killed.read(10, 100)] == ["w1", "w2", "x"]  # then killed
    await producer.publish(make_trajectory_group("w3"))
    elsewhere = TrajectoryConsumer(r, names, "trainer-old")  # w3 pending under another name
    assert [d.group.group_id for d in await elsewhere.read(1, 100)] == ["w3"]
    await producer.publish(make_trajectory_group("w1"))  # a producer's late retried copy of w1

    restarted = TrajectoryConsumer(r, names, "trainer-0")
    assert await restarted.ack_committed(["w1", "w2", "w3"]) == 2  # its own pending w1 and w2
    assert await trained_ids(r, names) == {"w1", "w2", "w3"}
    assert await restarted.ack_committed(["w1", "w2", "w3"]) == 0  # idempotent (a kill mid-resume)
    # Only x is left to train: the copy of w1, and w3 reclaimed from the other name, are trained.
    assert [d.group.group_id for d in await restarted.read(10, 100)] == ["x"]
    assert await restarted.read(10, 100) == []
    assert await restarted.reclaim(min_idle_ms=0) == []
    assert restarted.stats.duplicates_skipped == 3  # the copy, w3, and x (in flight here)
    assert await restarted.pending_count() == 1
    assert await restarted.recover_pending() == []  # x is in flight: not handed out again
    assert await restarted.pending_count() == 1 and await r.xlen(names.trajectories) == 1


async def test_a_lost_read_reply_is_recovered_and_trained_exactly_once(transport_redis, make_trajectory_group):
    """Redis delivered an entry in a reply the client never saw (redis-py retried the XREADGROUP):
    the inbox's periodic pass over its own pending list finds it; in-flight entries stay single."""
    from asyncrl.trainer.inbox import GroupInbox
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

    r, names = transport_redis, _names()
    producer = TrajectoryProducer(r, names)
    consumer = TrajectoryConsumer(r, names, "trainer-0")
    admission = Admission(r, names, batch_size=2, staleness=StalenessPolicy.global_budget(10), max_concurrent=8)
    inbox = GroupInbox(consumer, admission, batch_size=2, read_block_ms=50)
    inbox.pending_check_s = 0.0  # the periodic pass at every read
    await producer.publish(make_trajectory_group("a"))
    await inbox.read()
    assert [d.group.group_id for d in inbox.buffer] == ["a"]
    await producer.publish(make_trajectory_group("b"))
    lost = await r.xreadgroup(names.consumer_group, "trainer-0", {names.trajectories: ">"}, count=1)
    assert lost  # b is now pending for trainer-0, and the trainer never saw it
    for gid in ("c", "d"):
        await producer.publish(make_trajectory_group(gid))

    trained: list[str] = []
    for _ in range(8):
        await inbox.read()
        batch = inbox.take_batch()
        if batch is None:
            continue
        trained += [g.group_id for g in batch]
        await inbox.read()  # a pass while the batch is trained, not yet acked: nothing comes twice
        assert not {d.group.group_id for d in inbox.buffer} & set(trained)
        await inbox.ack_trained()
    assert sorted(trained) == ["a", "b", "c", "d"]
    assert consumer.stats.recovered == 1 and consumer.stats.acked_already_trained == 0
    assert await trained_ids(r, names) == {"a", "b", "c", "d"}
    assert await consumer.pending_count() == 0 and await r.xlen(names.trajectories) == 0


async def test_entries_a_dead_consumer_left_idle_are_reclaimed_periodically(transport_redis, make_trajectory_group):
    """Entries pending under another name (a previous pod) come back once idle for reclaim_idle_ms."""
    from asyncrl.trainer.inbox import GroupInbox
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

    r, names = transport_redis, _names()
    producer = TrajectoryProducer(r, names)
    for gid in ("a", "b"):
        await producer.publish(make_trajectory_group(gid))
    assert len(await TrajectoryConsumer(r, names, "trainer-gone").read(2, 100)) == 2  # then it died
    consumer = TrajectoryConsumer(r, names, "trainer-0")
    admission = Admission(r, names, batch_size=2, staleness=StalenessPolicy.global_budget(10), max_concurrent=8)
    inbox = GroupInbox(consumer, admission, batch_size=2, read_block_ms=50)
    await inbox.read()
    assert inbox.buffer == []  # not idle long enough yet / not time for a pass
    inbox.pending_check_s, inbox.reclaim_idle_ms = 0.0, 0
    await inbox.read()
    batch = inbox.take_batch()
    assert batch is not None and sorted(g.group_id for g in batch) == ["a", "b"]
    await inbox.ack_trained()
    assert await consumer.pending_count() == 0


# ---------------------------------------------------------------- the checkpoint's state and log


def test_state_json_holds_one_window_and_reads_older_checkpoints(tmp_path: Path) -> None:
    import json

    from asyncrl.trainer.state.checkpoint import TrainerState

    state = TrainerState(step=4, groups_trained=8, window_start_step=2, window_group_ids=["c", "d"])
    data = json.loads(json.dumps(state.to_json()))
    assert "trained_group_ids" not in data
    assert TrainerState.from_json(data) == state
    state.start_window()
    assert (state.window_start_step, state.window_group_ids, state.groups_trained) == (4, [], 8)
    # A state.json of the previous format lists the whole lineage: read as one (superset) window.
    old = TrainerState.from_json({"step": 3, "groups_trained": 3, "trained_group_ids": ["a", "b", "c"]})
    assert (old.step, old.window_group_ids) == (3, ["a", "b", "c"])


def test_lineage_log_is_appended_and_cut_back_to_the_checkpoint(tmp_path: Path) -> None:
    """One line per checkpoint (its window); a resume cuts off lines of a lost timeline and a
    half-written line, so the log is exactly the newest checkpoint's lineage."""
    from asyncrl.trainer.state.checkpoint import (
        TRAINED_LOG,
        TrainerState,
        append_trained,
        lineage_group_ids,
        truncate_trained_log,
    )

    for step, ids in ((2, ["a", "b"]), (4, ["c", "d"]), (6, ["e", "f"])):
        append_trained(tmp_path, TrainerState(step=step, window_start_step=step - 2, window_group_ids=ids))
    assert lineage_group_ids(tmp_path, 6) == ["a", "b", "c", "d", "e", "f"]
    assert lineage_group_ids(tmp_path, 5) == ["a", "b", "c", "d"]
    assert lineage_group_ids(tmp_path) == []  # no checkpoint: no lineage
    with open(tmp_path / TRAINED_LOG, "a") as fh:
        fh.write('{"step": 8, "group_ids": ["g"')  # a writer killed mid-line
    assert lineage_group_ids(tmp_path, 9) == ["a", "b", "c", "d", "e", "f"]
    # Resumed from step 4 (checkpoint 6 never landed): its line and the partial one are cut off.
    truncate_trained_log(tmp_path, 4)
    assert len((tmp_path / TRAINED_LOG).read_text().splitlines()) == 2
    append_trained(tmp_path, TrainerState(step=5, window_start_step=4, window_group_ids=["e", "x"]))
    assert lineage_group_ids(tmp_path, 5) == ["a", "b", "c", "d", "e", "x"]
    truncate_trained_log(tmp_path, 5)  # nothing after the checkpoint: nothing cut
    assert len((tmp_path / TRAINED_LOG).read_text().splitlines()) == 3
