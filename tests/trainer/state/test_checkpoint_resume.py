"""Checkpoint/resume: atomic checkpoints, and a trainer SIGKILLed at random moments trains every
group at most once and never loses an acknowledged group (checked by group ids)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from asyncrl.local.redis_server import LocalRedis
from asyncrl.transport.streams import trained_ids
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import (
    ASYNCRL,
    make_groups,
    publish,
    read_jsonl,
    redis_query,
    stop_trainer,
    trainer_env,
    wait_for_outcome,
)

JOB = "t-resume"


def test_checkpoint_round_trip_is_atomic_and_bounded(tmp_path: Path) -> None:
    from asyncrl.trainer.state.checkpoint import (
        TrainerState,
        checkpoint_dirs,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    (tmp_path / ".step-000009-stray").mkdir()  # a writer killed mid-checkpoint left this
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, TrainerState(step=step, version=step, window_start_step=step - 1,
                                                           window_group_ids=[f"g{step}"]))
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 3]  # keeps the newest two
    assert not list(tmp_path.glob(".step-*"))
    expected_rand = torch.rand(3)  # the RNG stream right after the checkpoint ...
    torch.manual_seed(123)

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    state = load_checkpoint(latest_checkpoint(tmp_path), model2, opt2)
    assert state.step == 3 and state.version == 3
    assert (state.window_start_step, state.window_group_ids) == (2, ["g3"])
    assert torch.equal(model.weight, model2.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    # ... is restored: the RNG state saved at step 3 was taken before expected_rand was drawn.
    assert torch.equal(torch.rand(3), expected_rand)


def test_rng_state_round_trips_without_pickle_and_an_old_pickle_is_never_loaded(tmp_path: Path, caplog) -> None:
    """The generators' state is a safetensors file (tensors and strings); an old checkpoint's pickled
    rng*.pt, on a volume rollout pods can write, is left alone: loading it would run its code."""
    import pickle

    import numpy as np

    from asyncrl.trainer.state.rng_state import load_rng_state, rng_file, save_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # (each keeps a cached Gaussian: state beyond the keys)
    save_rng_state(rng_file(tmp_path, 0))
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert load_rng_state(tmp_path, 3), "a rank without its own file takes rank 0's"
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (tmp_path / "old" / "pwned", "ran"))

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "rng.pt").write_bytes(pickle.dumps(Payload()))
    assert not load_rng_state(tmp_path / "old", 0)
    assert not (tmp_path / "old" / "pwned").exists()
    assert "is not loaded from a shared volume" in caplog.text


def _lineage(ckpt_root: Path) -> list[str]:
    """Group ids the newest checkpoint's weights were trained on (its lineage log), in order."""
    from asyncrl.trainer.state.checkpoint import lineage_group_ids

    return lineage_group_ids(ckpt_root)


def _redis_state(url: str) -> tuple[set[str], int, int]:
    from asyncrl.api.stream_names import StreamNames

    names = StreamNames.for_job(JOB)

    async def q(r):
        trained = await trained_ids(r, names)
        pending = (await r.xpending(names.trajectories, names.consumer_group))["pending"]
        return trained, pending, await r.xlen(names.trajectories)

    return redis_query(url, q)


@pytest.mark.slow
def test_sigkill_at_random_moments_trains_each_group_at_most_once(tmp_path: Path) -> None:
    steps, batch = 4, 2
    job = JobBuilder.small(name=JOB, batch_size=batch, max_steps=steps, checkpoint_interval=2,
                           eta=10, lr=1e-5).write(tmp_path / "job.yaml")
    groups = make_groups(JOB, steps * batch, version=0)
    all_ids = {g.group_id for g in groups}
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    with LocalRedis(tmp_path / "redis") as redis:
        publish(redis.url, JOB, groups)
        env = trainer_env(tmp_path, redis.url)
        cmd = ASYNCRL + ["trainer", "--config", str(job), "--no-status", "--threads", "1"]
        kills = 0
        log = open(tmp_path / "trainer.log", "ab")
        while True:
            serving_before = _serving_lines(tmp_path / "trainer.log") + 1
            proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
            if kills < 3:
                delay = rng.uniform(3.0, 20.0)
                try:
                    proc.wait(delay)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    # Invariant at every crash: whatever Redis says is acknowledged is part of the
                    # lineage saved in the newest checkpoint (no acknowledged group is lost).
                    trained, _, _ = _redis_state(redis.url)
                    lineage = _lineage(tmp_path / "checkpoints")
                    assert trained <= set(lineage), (seed, trained - set(lineage))
                    assert len(lineage) == len(set(lineage)), seed
                    continue
                raise AssertionError((seed, proc.returncode, (tmp_path / "trainer.log").read_text()[-3000:]))
            # The last start trains to the end (or, killed after that, serves the recorded outcome):
            # it records Succeeded and stays up until SIGTERM.
            outcome = wait_for_outcome(redis.url, JOB, proc, timeout=600, log=tmp_path / "trainer.log")
            assert (outcome.phase, outcome.step) == ("Succeeded", steps), seed
            # The record may predate this start (the previous one finished, then was killed): wait
            # until this process serves it, or the SIGTERM lands before its handlers are installed.
            deadline = time.monotonic() + 300
            while _serving_lines(tmp_path / "trainer.log") < serving_before:
                assert proc.poll() is None and time.monotonic() < deadline, (seed, proc.returncode)
                time.sleep(0.2)
            assert stop_trainer(proc) == 0, (seed, (tmp_path / "trainer.log").read_text()[-3000:])
            break
        trained, pending, length = _redis_state(redis.url)

    lineage = _lineage(tmp_path / "checkpoints")
    assert len(lineage) == len(set(lineage)) == steps * batch, seed  # each group trained once
    assert set(lineage) == all_ids == trained, seed                  # and every one acknowledged
    assert pending == 0 and length == 0
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), seed  # lost steps were rewritten
    assert (tmp_path / "weights" / f"v{steps}" / "model.safetensors").exists()
    assert not list((tmp_path / "weights").glob(".v*")) and not list((tmp_path / "checkpoints").glob(".step-*"))


def _serving_lines(log: Path) -> int:
    """How many trainer starts so far reached the point of serving an outcome (and handle SIGTERM)."""
    if not log.exists():
        return 0
    text = log.read_text(errors="replace")
    return text.count("trainer finished: ") + text.count("serving it without loading the model")
