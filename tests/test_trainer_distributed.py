"""torchrun with 2 gloo processes trains exactly like 1 process on the same data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_support import ASYNCRL, make_groups, publish, read_jsonl, trainer_env, write_job

from asyncrl.local_redis import LocalRedis
from asyncrl.net import free_port

JOB = "t-dist"


def _run(tmp: Path, world: int, groups: list) -> list[dict]:
    tmp.mkdir()
    job = write_job(tmp / "job.yaml", name=JOB, batch_size=2, max_steps=2, minibatches=2,
                    micro_batch_tokens=60, lr=1e-5, checkpoint_interval=5)
    with LocalRedis(tmp / "redis") as redis:
        publish(redis.url, JOB, groups)
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, f"--nproc-per-node={world}", f"--master-port={free_port()}", ASYNCRL[0],
               "trainer", "--config", str(job), "--no-status", "--threads", "1", "--exit-on-outcome"]
        proc = subprocess.run(cmd, env=trainer_env(tmp, redis.url), cwd=tmp, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_jsonl(tmp / "metrics.jsonl")


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    groups = make_groups(JOB, 4, version=0, max_len=8)
    one = _run(tmp_path / "world1", 1, groups)
    two = _run(tmp_path / "world2", 2, groups)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["tokens"] == a["tokens"] and b["reward_mean"] == a["reward_mean"]
    # The trajectory moves (the comparison is not between two constant losses).
    assert one[0]["loss"] != pytest.approx(one[1]["loss"], rel=1e-3)

    from safetensors.torch import load_file

    w1 = load_file(tmp_path / "world1" / "weights" / "v2" / "model.safetensors")
    w2 = load_file(tmp_path / "world2" / "weights" / "v2" / "model.safetensors")
    from asyncrl.models import resolve_model_path

    w0 = load_file(Path(resolve_model_path("embedded:SmolLM2-135M-Instruct")) / "model.safetensors")
    assert w1.keys() == w2.keys() == w0.keys()
    # Both moved from the initial weights, and by far more than they differ from each other
    # (AdamW's per-parameter normalisation turns float rounding on near-zero gradients into
    # occasional lr-sized differences, so compare norms, not single elements).
    update = sum(float(((w1[k] - w0[k]) ** 2).sum()) for k in w1) ** 0.5
    diff = sum(float(((w1[k] - w2[k]) ** 2).sum()) for k in w1) ** 0.5
    assert update > 0 and diff < 0.02 * update, (diff, update)
