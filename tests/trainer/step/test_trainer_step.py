"""The trainer's step on the real SmolLM2 with synthetic groups in a real Redis."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.transport.streams import trained_ids
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import make_groups, model_and_tokenizer, publish, redis_query

JOB = "t-step"


def _runtime(tmp_path: Path, redis_url: str):
    from asyncrl.api.runtime import Runtime

    return Runtime(redis_url=redis_url, weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                   run_dir=tmp_path, pod_name="trainer-0")


@pytest.mark.slow
def test_steps_publish_versions_write_weights_and_ack(tmp_path: Path, redis_url: str) -> None:
    from asyncrl.api.loader import load_job
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.main import build_trainer, connect_io
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.versions import VersionChannel

    job = load_job(JobBuilder.small(name=JOB, batch_size=2, eta=1, max_steps=2,
                                    checkpoint_interval=1).write(tmp_path / "job.yaml"))
    fresh = make_groups(JOB, 4, version=0)
    publish(redis_url, JOB, fresh)
    runtime = _runtime(tmp_path, redis_url)
    args = argparse.Namespace(max_steps=2, no_resume=False)

    async def go():
        io = await connect_io(job, runtime)
        trainer = build_trainer(job, args, runtime, DistContext(), io)
        phase = await trainer.run()
        await io.redis.aclose()
        return trainer, phase

    trainer, phase = asyncio.run(go())
    assert phase == "Succeeded"
    assert trainer.state.step == 2 and trainer.state.version == 2

    names = StreamNames.for_job(JOB)

    async def inspect(r):
        latest = await VersionChannel(r, names).latest()
        snap = await Admission(r, names, batch_size=2, staleness=StalenessPolicy.global_budget(1),
                               max_concurrent=4).snapshot()
        trained = await trained_ids(r, names)
        pending = (await r.xpending(names.trajectories, names.consumer_group))["pending"]
        length = await r.xlen(names.trajectories)
        return latest, snap, trained, pending, length

    latest, snap, trained, pending, length = redis_query(redis_url, inspect)
    assert latest is not None and latest.version == 2
    assert Path(latest.weights_path) == (tmp_path / "weights" / "v2").resolve()
    assert snap.version == 2
    # Every trained group is acknowledged (marked trained, entry deleted), nothing left pending.
    assert trained == {g.group_id for g in fresh}
    assert pending == 0 and length == 0
    from asyncrl.trainer.state.checkpoint import lineage_group_ids

    lineage = lineage_group_ids(tmp_path / "ckpt")  # what the newest checkpoint was trained on
    assert sorted(lineage) == sorted(trained) and len(lineage) == len(set(lineage))
    # Oldest first: groups were created in order, so step 1 trained the first two.
    assert lineage[:2] == ["g0000", "g0001"]

    # Weights: complete HF directories, no temporary leftovers; v1 kept (previous), v2 newest.
    weights = tmp_path / "weights"
    assert (weights / "v2" / "config.json").exists()
    assert (weights / "v2" / "model.safetensors").exists()
    assert (weights / "v2" / "tokenizer.json").exists()
    assert not [p for p in weights.iterdir() if p.name.startswith(".")]
    from asyncrl.infra.hf_models import load_causal_lm

    reloaded = load_causal_lm(str(weights / "v2"))
    trained_sd = trainer.model.state_dict()
    assert all(torch.equal(v, trained_sd[k]) for k, v in reloaded.state_dict().items())
    base, _ = model_and_tokenizer()
    assert not torch.equal(base.model.layers[0].mlp.up_proj.weight, reloaded.model.layers[0].mlp.up_proj.weight)

    # metrics.jsonl: one line per step with the figures the status report needs.
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert [x["policy_version"] for x in lines] == [1, 2]
    for x in lines:
        assert x["tokens"] > 0 and x["staleness_max"] <= 1
        assert abs(x["reward_mean"] - 0.5) < 1e-9
    report = trainer.get_report()
    assert report.phase == "Succeeded" and report.step == 2 and report.groups_trained == 4
    # the reason the outcome record will carry, already: /status may be read before it is recorded
    assert (report.reason, report.message) == ("MaxStepsReached", "reached maxSteps=2")
    assert report.tokens_trained == sum(x["tokens"] for x in lines)
    assert report.reward_history == [0.5, 0.5]
    assert sum(report.staleness.histogram.values()) == report.tokens_trained
    assert report.staleness.histogram.get("1", 0) > 0  # step 2 trained version-0 tokens at version 1
    assert report.last_checkpoint and Path(report.last_checkpoint).name == "step-000002"


@pytest.mark.slow
def test_over_stale_groups_are_dropped_counted_and_acked(tmp_path: Path, redis_url: str) -> None:
    from asyncrl.api.loader import load_job
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.main import build_trainer, connect_io
    from asyncrl.trainer.state.checkpoint import TrainerState

    job = load_job(JobBuilder.small(name=JOB, batch_size=2, eta=1, max_steps=4,
                                    checkpoint_interval=10).write(tmp_path / "job.yaml"))
    stale = make_groups(JOB, 1, version=0, prefix="old")
    fresh = make_groups(JOB, 2, version=3, prefix="new", seed=1)
    publish(redis_url, JOB, stale + fresh)
    runtime = _runtime(tmp_path, redis_url)

    async def go():
        io = await connect_io(job, runtime)
        trainer = build_trainer(job, argparse.Namespace(max_steps=4, no_resume=True), runtime,
                                DistContext(), io)
        trainer.state = TrainerState(step=3, version=3)  # as if three steps were already trained
        phase = await trainer.run()
        await io.redis.aclose()
        return trainer, phase

    trainer, phase = asyncio.run(go())
    assert phase == "Succeeded"
    assert trainer.state.dropped == 1
    from asyncrl.trainer.state.checkpoint import lineage_group_ids

    assert lineage_group_ids(tmp_path / "ckpt") == ["new0000", "new0001"]
    assert trainer.get_report().staleness.dropped == 1
    names = StreamNames.for_job(JOB)

    async def inspect(r):
        return ((await r.xpending(names.trajectories, names.consumer_group))["pending"],
                int(await r.hget(names.admission, "dropped") or 0))

    pending, dropped = redis_query(redis_url, inspect)
    assert pending == 0 and dropped == 1


@pytest.mark.slow
def test_micro_batches_give_the_exact_token_mean(tmp_path: Path) -> None:
    """Splitting a minibatch into small micro-batches changes neither the loss nor the gradient."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.step.plan import plan_step, sequences_with_advantages

    groups = make_groups(JOB, 2, version=0, max_len=12)
    base, tok = model_and_tokenizer()
    results = []
    for budget in (100_000, 40):
        model = type(base)(base.config)
        model.load_state_dict(base.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        job = JobBuilder.small(name=JOB, batch_size=2, eta=2, micro_batch_tokens=budget, grad_clip=1e9,
                               proximal="recompute").job()
        trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model, opt, tok)
        algo = job.spec.algorithm
        [plan] = plan_step(groups, sequences_with_advantages(groups, algo), algo)
        record = trainer.train_step(groups)
        results.append((len(plan.micro_batches), record.loss, record.grad_norm))
    (n_big, loss_big, norm_big), (n_small, loss_small, norm_small) = results
    assert n_big == 1 and n_small > 2
    assert loss_small == pytest.approx(loss_big, rel=1e-4, abs=1e-6)
    assert norm_small == pytest.approx(norm_big, rel=1e-4)


def test_weights_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch
    import torch

    from asyncrl.trainer.weights.files import published_versions, write_weights

    def disk_full(tensors: dict, path: Path, **kw: object) -> None:
        Path(path).write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="disk full"):
        write_weights(torch.nn.Linear(2, 2), None, tmp_path, 3)
    assert published_versions(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # neither v3 nor a temporary directory remains


def test_prune_keeps_versions_in_use(tmp_path: Path) -> None:
    from asyncrl.trainer.weights.files import prune_weights, published_versions

    for v in range(6):
        (tmp_path / f"v{v}").mkdir()
    removed = prune_weights(tmp_path, {2, 4}, newest=5)
    assert sorted(removed) == [0, 1, 3]
    assert published_versions(tmp_path) == [2, 4, 5]


def test_engine_update_failure_names_the_server(tmp_path: Path) -> None:
    from asyncrl.infra.net import free_port
    from asyncrl.trainer.weights.engine_update import WeightSyncError, update_engines

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(WeightSyncError) as err:
        asyncio.run(update_engines("hf", [url], tmp_path, 1, timeout_s=10))
    assert url in str(err.value)
    assert list(err.value.failures) == [url]


def test_restart_discards_newer_versions_and_half_written_temp_dirs(tmp_path):
    from asyncrl.trainer.weights.files import drop_versions_after, published_versions

    for name in ("v1", "v2", "v3", ".v3-k1ll3d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    assert drop_versions_after(tmp_path, 1) == [2, 3]
    assert published_versions(tmp_path) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


@pytest.mark.parametrize("objective", ["gspo", "cispo", "sapo", "bapo"])
def test_each_objective_trains(tmp_path: Path, objective: str) -> None:
    """Two real steps of the trainer on the tiny model with each objective: finite loss, weights move."""
    import numpy as np

    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig
    from tests.support.trainer_support import own_behaviour_groups, tiny_model

    _, tok = model_and_tokenizer()
    model = tiny_model()
    groups = own_behaviour_groups(model, JOB, 2)  # behaviour: the tiny model's own, so ratios start at 1
    algorithm = {"bapo": {}} if objective == "bapo" else {"objective": objective}  # (bapo: ppo-clip's bounds)
    job = JobBuilder.small(name=JOB, batch_size=2, algorithm=algorithm).job()
    trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model,
                      torch.optim.AdamW(model.parameters(), lr=1e-3), tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    records = [trainer.train_step(groups) for _ in range(2)]
    assert all(np.isfinite(r.loss) and np.isfinite(r.grad_norm) and r.grad_norm > 0 for r in records)
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert records[1].importance_weight_max != 1.0  # the second step saw a moved policy
    assert objective != "bapo" or all(0.6 <= r.bapo_clip_low <= 0.8 <= 1.2 <= r.bapo_clip_high for r in records)
