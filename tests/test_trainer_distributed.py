"""torchrun with 2 gloo processes trains exactly like 1 process on the same data.

This file is also the script of the DDP log-prob check (`_ddp_logprobs_worker`, run under torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


CHUNK = 6
"""chunk_tokens of the DDP log-prob check: every LM-head call of the chunked path has at most
this many rows; the full-logits fallback calls it once on all [N, L] positions."""


@pytest.mark.slow
def test_ddp_takes_the_chunked_head_with_the_unwrapped_gradients(tmp_path: Path) -> None:
    """Under DDP the LM head runs in chunks (no [N, L, V] logits), with and without the head's
    activation checkpointing, and each rank's log-probs and its (all-reduced) gradient equal the
    unwrapped model's on the same data."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [torchrun, "--nproc-per-node=2", f"--master-port={free_port()}", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        for result in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert result["head_rows"] and max(result["head_rows"]) <= CHUNK, result
            assert result["logprob_diff"] <= 1e-5, result
            assert result["grad_diff"] <= 1e-5 * result["grad_scale"], result


def _ddp_logprobs_worker(out: Path) -> None:
    """One torchrun rank: rank r scores group r. Reference first (the bare model, both groups, the
    mean of their gradients: what DDP's all-reduce gives), then the DDP-wrapped model."""
    import torch
    from trainer_support import make_job, model_and_tokenizer

    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.batch import build_batch
    from asyncrl.trainer.logprobs import token_logprobs
    from asyncrl.trainer.plan import sequences_with_advantages

    torch.set_num_threads(1)
    ctx = D.init_distributed("cpu")
    model, _ = model_and_tokenizer()
    groups = make_groups(JOB, ctx.world_size, version=0, max_len=8)
    algo = make_job(name=JOB).spec.algorithm
    batches = []
    for g in groups:
        seqs = sequences_with_advantages([g], algo)
        batches.append(build_batch(seqs, 0, advantages=[s.advantage for s in seqs]))

    def score(m: Any, batch: Any, checkpoint_head: bool) -> Any:
        lp, _ = token_logprobs(m, batch.input_ids, batch.attention_mask, 0.7, mask=batch.loss_mask,
                               chunk_tokens=CHUNK, checkpoint_head=checkpoint_head)
        (lp * torch.linspace(-1.0, 1.0, lp.shape[-1])).sum().backward()
        return lp.detach()

    def grads() -> dict[str, Any]:
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    model.zero_grad(set_to_none=True)
    own_lp = score(model, batches[ctx.rank], False)
    ref_grads = [grads()]
    for b in batches[:ctx.rank] + batches[ctx.rank + 1:]:
        score(model, b, False)
        ref_grads.append(grads())
    reference = {n: sum(g[n] for g in ref_grads) / ctx.world_size for n in ref_grads[0]}

    ddp = D.wrap_model(model, ctx)
    head_rows: list[int] = []
    D.unwrap(ddp).get_output_embeddings().register_forward_hook(
        lambda mod, args, output: head_rows.append(int(args[0].numel() // args[0].shape[-1])))
    results = []
    for checkpoint_head in (False, True):
        head_rows.clear()
        lp = score(ddp, batches[ctx.rank], checkpoint_head)
        got = grads()
        results.append({
            "checkpoint_head": checkpoint_head, "head_rows": [r for r in head_rows if r],
            "logprob_diff": float((lp - own_lp).abs().max()),
            "grad_diff": max(float((got[n] - reference[n]).abs().max()) for n in reference),
            "grad_scale": max(float(reference[n].abs().max()) for n in reference)})
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(results))
    D.shutdown(ctx)


if __name__ == "__main__":
    _ddp_logprobs_worker(Path(sys.argv[1]))
