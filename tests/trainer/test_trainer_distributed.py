"""torchrun with 2 gloo processes trains exactly like 1 process on the same data, with FSDP2
(the default) and with DDP, and a sharded checkpoint resumes at another world size. The trainer
runs train the two-layer model of SmolLM2's architecture (the `tiny_model_dir` fixture): what is
compared is the wrapping, sharding and reduction, the same code at any size.

This file is also the script of the wrapper check (`_wrapper_worker`, run under torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl.infra.net import free_port
from asyncrl.local.redis_server import LocalRedis
from tests.support.jobs import REPO, JobBuilder
from tests.support.trainer_support import ASYNCRL, make_groups, publish, read_jsonl, trainer_env

JOB = "t-dist"


def _trainer(tmp: Path, redis_url: str, world: int, job: Path, *extra: str) -> None:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, f"--nproc-per-node={world}", f"--master-port={free_port()}", ASYNCRL[0],
           "trainer", "--config", str(job), "--no-status", "--threads", "1", "--exit-on-outcome", *extra]
    proc = subprocess.run(cmd, env=trainer_env(tmp, redis_url), cwd=tmp, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _run(tmp: Path, groups: list, model_dir: Path, *lives: tuple[int, int], trainer: dict[str, Any] | None = None,
         model: dict[str, Any] | None = None) -> list[dict]:
    """One job on `groups` with the model at `model_dir`, trained by one trainer life per (world size,
    max steps), each resuming from the last one's checkpoint; its metrics.jsonl."""
    tmp.mkdir()
    job = JobBuilder.small(name=JOB, batch_size=2, max_steps=2, minibatches=2, micro_batch_tokens=60, lr=1e-5,
                           checkpoint_interval=5, trainer=trainer,
                           model={"path": str(model_dir), **(model or {})}).write(tmp / "job.yaml")
    with LocalRedis(tmp / "redis") as redis:
        publish(redis.url, JOB, groups)
        for world, steps in lives:
            _forget_outcome(tmp, redis.url)  # (a life that reached its --max-steps recorded Succeeded)
            _trainer(tmp, redis.url, world, job, "--max-steps", str(steps))
    return read_jsonl(tmp / "metrics.jsonl")


def _forget_outcome(tmp: Path, redis_url: str) -> None:
    """Clear the recorded outcome, so the next life trains on from the checkpoint instead of serving it."""
    import redis

    from asyncrl.api.outcome import OUTCOME_FILE
    from asyncrl.api.stream_names import StreamNames

    redis.Redis.from_url(redis_url).delete(StreamNames.for_job(JOB, "").outcome)
    (tmp / "weights" / OUTCOME_FILE).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def runs(module_dir: Path, tiny_model_dir: Path) -> dict[str, Path]:
    """The same 2 steps (2 updates each) on the same 4 groups: one process; 2 ranks with DDP; step 1
    on 2 ranks with FSDP (activation checkpointing on), step 2 on 1 process resumed from its
    sharded checkpoint (so FSDP's updates and its checkpoint are both compared with one process)."""
    groups = make_groups(JOB, 4, version=0, max_len=8)
    _run(module_dir / "world1", groups, tiny_model_dir, (1, 2))
    _run(module_dir / "ddp2", groups, tiny_model_dir, (2, 2), trainer={"parallelism": "ddp"})
    _run(module_dir / "fsdp2-then-1", groups, tiny_model_dir, (2, 1), (1, 2), trainer={"parallelism": "fsdp"},
         model={"gradientCheckpointing": True})
    return {name: module_dir / name for name in ("world1", "ddp2", "fsdp2-then-1")}


def _weights(run: Path, version: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(run / "weights" / f"v{version}" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("other", ["ddp2", "fsdp2-then-1"])
def test_two_gloo_processes_match_one_process(runs: dict[str, Path], tiny_model_dir: Path, other: str) -> None:
    one, two = read_jsonl(runs["world1"] / "metrics.jsonl"), read_jsonl(runs[other] / "metrics.jsonl")
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["tokens"] == a["tokens"] and b["reward_mean"] == a["reward_mean"]
    # The trajectory moves (the comparison is not between two constant losses).
    assert one[0]["loss"] != pytest.approx(one[1]["loss"], rel=1e-3)

    w1, w2 = _weights(runs["world1"], 2), _weights(runs[other], 2)
    w0 = _load_base(tiny_model_dir)
    assert w1.keys() == w2.keys() == w0.keys()
    # Both moved from the initial weights, and by far more than they differ from each other
    # (AdamW's per-parameter normalisation turns float rounding on near-zero gradients into
    # occasional lr-sized differences, so compare norms, not single elements).
    update = sum(float(((w1[k] - w0[k]) ** 2).sum()) for k in w1) ** 0.5
    diff = sum(float(((w1[k] - w2[k]) ** 2).sum()) for k in w1) ** 0.5
    assert update > 0 and diff < 0.02 * update, (diff, update)


def _load_base(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.slow
def test_a_sharded_checkpoint_is_dcp_and_resumes_at_another_world_size(runs: dict[str, Path]) -> None:
    """The FSDP life wrote a DCP checkpoint (shards of both ranks, both RNG states); the one-process
    life resumed from it (step 2 only: step 1's groups were acknowledged, not trained again)."""
    ckpts = sorted((runs["fsdp2-then-1"] / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-000001", "step-000002"]
    first = ckpts[0]
    assert (first / ".metadata").is_file() and list(first.glob("*.distcp"))
    assert (first / "rng-0.safetensors").is_file() and (first / "rng-1.safetensors").is_file()
    assert not list((runs["fsdp2-then-1"] / "checkpoints").glob(".step-*"))  # no temporary left
    lineage = [json.loads(line) for line in (runs["fsdp2-then-1"] / "checkpoints" / "trained-groups.jsonl")
               .read_text().splitlines()]
    assert [e["step"] for e in lineage] == [1, 2]
    ids = [g for e in lineage for g in e["group_ids"]]
    assert len(ids) == len(set(ids)) == 4


CHUNK = 6
"""chunk_tokens of the DDP log-prob check: every LM-head call of the chunked path has at most
this many rows; the full-logits fallback calls it once on all [N, L] positions."""


@pytest.mark.slow
def test_wrapped_models_take_the_chunked_head_with_the_unwrapped_gradients(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    """Under DDP and FSDP the LM head runs in chunks (no [N, L, V] logits), with and without the
    head's activation checkpointing, and each rank's log-probs and its (reduced) gradient equal the
    unwrapped model's on the same data. FSDP with a bfloat16 model dtype keeps float32 shards and
    publishes bfloat16 weights, gathered in buckets into an HF directory transformers loads. And the
    trainer's FSDP load (only rank 0 reads the weights) gives every rank the same model."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # (this file run as a script: the repository root on the path, for its `tests.support` imports)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    cmd = [torchrun, "--nproc-per-node=2", f"--master-port={free_port()}", __file__, str(tmp_path), str(tiny_model_dir)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [(r["parallelism"], r["checkpoint_head"]) for r in results] == \
            [("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)]
        for result in results:
            assert result["head_rows"] and max(result["head_rows"]) <= CHUNK, result
            assert result["logprob_diff"] <= 1e-5, result
            assert result["grad_diff"] <= 1e-5 * result["grad_scale"], result
    published = json.loads((tmp_path / "published.json").read_text())
    assert published["shard_dtype"] == "torch.float32" and published["compute_dtype"] == "torch.bfloat16"
    assert published["files"] > 1 and published["index"]  # several buckets, with HF's index
    assert published["loaded_dtype"] == "torch.bfloat16" and published["max_diff"] == 0.0
    for rank in (0, 1):  # the model sharded with only rank 0 loading it: the same model on every rank
        loaded = json.loads((tmp_path / f"sharded-load{rank}.json").read_text())
        assert loaded == {"sharded": True, "params_equal": True, "params": True, "buffers_equal": True,
                          "generation_config": True, "attention": True, "checkpointing": True}, (rank, loaded)


def _wrapper_worker(out: Path, model_dir: Path) -> None:
    """One torchrun rank: rank r scores group r. Reference first (the bare model at `model_dir`, both
    groups, the mean of their gradients: what the wrappers' reduction gives), then each wrapper on a copy."""
    import copy

    import torch

    from asyncrl.infra.hf_models import load_causal_lm
    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.step.batch import build_batch
    from asyncrl.trainer.step.logprobs import token_logprobs
    from asyncrl.trainer.step.plan import sequences_with_advantages

    torch.set_num_threads(1)
    ctx = D.init_distributed("cpu")
    model = load_causal_lm(str(model_dir), "float32", "cpu")
    groups = make_groups(JOB, ctx.world_size, version=0, max_len=8)
    algo = JobBuilder.small(name=JOB).job().spec.algorithm
    batches = []
    for g in groups:
        seqs = sequences_with_advantages([g], algo)
        batches.append(build_batch(seqs, 0, advantages=[s.advantage for s in seqs]))

    def score(m: Any, batch: Any, checkpoint_head: bool) -> Any:
        lp, _ = token_logprobs(m, batch.input_ids, batch.attention_mask, 0.7, mask=batch.loss_mask,
                               chunk_tokens=CHUNK, checkpoint_head=checkpoint_head)
        (lp * torch.linspace(-1.0, 1.0, lp.shape[-1])).sum().backward()
        return lp.detach()

    def grads(m: Any) -> dict[str, Any]:
        named = D.unwrap(m).named_parameters()
        got = {n: D.full_tensor(p.grad).clone() for n, p in named}
        m.zero_grad(set_to_none=True)
        return got

    model.zero_grad(set_to_none=True)
    own_lp = score(model, batches[ctx.rank], False)
    ref_grads = [grads(model)]
    for b in batches[:ctx.rank] + batches[ctx.rank + 1:]:
        score(model, b, False)
        ref_grads.append(grads(model))
    reference = {n: sum(g[n] for g in ref_grads) / ctx.world_size for n in ref_grads[0]}

    results = []
    for parallelism in ("ddp", "fsdp"):
        wrapped = D.wrap_model(copy.deepcopy(model), ctx, parallelism)
        head_rows: list[int] = []
        D.unwrap(wrapped).get_output_embeddings().register_forward_hook(
            lambda mod, args, output, rows=head_rows: rows.append(int(args[0].numel() // args[0].shape[-1])))
        for checkpoint_head in (False, True):
            head_rows.clear()
            lp = score(wrapped, batches[ctx.rank], checkpoint_head)
            got = grads(wrapped)
            results.append({
                "parallelism": parallelism, "checkpoint_head": checkpoint_head,
                "head_rows": [r for r in head_rows if r],
                "logprob_diff": float((lp - own_lp).abs().max()),
                "grad_diff": max(float((got[n] - reference[n]).abs().max()) for n in reference),
                "grad_scale": max(float(reference[n].abs().max()) for n in reference)})
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(results))
    _publish_bf16(model, ctx, out)
    _sharded_load(model, ctx, out, model_dir)
    D.shutdown(ctx)


def _sharded_load(model: Any, ctx: Any, out: Path, model_dir: Path) -> None:
    """load_sharded_model: rank 0 loads, the other ranks build on the meta device; every rank's
    shards, buffers (the rotary frequencies a state dict leaves out), generation config and
    attention implementation then equal those of the model loaded whole."""
    import torch

    from asyncrl.trainer import distributed as D

    sharded = D.load_sharded_model(str(model_dir), ctx, gradient_checkpointing=True)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    (out / f"sharded-load{ctx.rank}.json").write_text(json.dumps({
        "sharded": D.is_sharded(sharded),
        "params_equal": all(torch.equal(D.full_tensor(p), params[n]) for n, p in sharded.named_parameters()),
        "params": sorted(n for n, _ in sharded.named_parameters()) == sorted(params),
        "buffers_equal": all(torch.equal(b, buffers[n]) for n, b in sharded.named_buffers()),
        "generation_config": sharded.generation_config.to_dict() == model.generation_config.to_dict(),
        "attention": sharded.config._attn_implementation == model.config._attn_implementation,
        "checkpointing": sharded.is_gradient_checkpointing}))


def _publish_bf16(model: Any, ctx: Any, out: Path) -> None:
    """FSDP with compute in bfloat16: float32 shards, bfloat16 compute, bfloat16 weights written in
    buckets of 1 MB (several files and the index) that transformers loads equal to the model's."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.weights.files import INDEX_FILE, write_weights

    sharded = D.wrap_model(copy.deepcopy(model), ctx, "fsdp", compute_dtype=torch.bfloat16)
    shard = next(iter(sharded.parameters()))
    seen: list[Any] = []

    def output_dtype(module: Any, args: Any, output: Any) -> None:
        seen.append((output[0] if isinstance(output, tuple) else output).dtype)

    handle = sharded.model.layers[0].register_forward_hook(output_dtype)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        sharded(input_ids=ids, attention_mask=torch.ones_like(ids))
    handle.remove()
    path = write_weights(sharded, None, out / "weights", 1, dtype=torch.bfloat16, ctx=ctx, bucket_bytes=1 << 20)
    if ctx.is_main:
        assert path is not None
        loaded = AutoModelForCausalLM.from_pretrained(path)
        expected = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        got = dict(loaded.named_parameters())
        (out / "published.json").write_text(json.dumps({
            "shard_dtype": str(shard.dtype), "compute_dtype": str(seen[0]),
            "files": len(list(path.glob("*.safetensors"))), "index": (path / INDEX_FILE).is_file(),
            "loaded_dtype": str(loaded.dtype),
            "max_diff": max(float((got[n].detach() - expected[n]).abs().max()) for n in expected)}))
    else:
        assert path is None


if __name__ == "__main__":
    _wrapper_worker(Path(sys.argv[1]), Path(sys.argv[2]))


LORA = {"lora": {"rank": 8, "alpha": 16}}


@pytest.fixture(scope="module")
def lora_runs(module_dir: Path, tiny_model_dir: Path) -> dict[str, Path]:
    """LoRA (trainer.lora) on the same 2 steps: one process; step 1 on 2 FSDP ranks (the frozen base
    sharded with the adapters, activation checkpointing on), step 2 on 1 process resumed from its
    checkpoint (the adapter and its optimizer state only); and 2 DDP ranks."""
    groups = make_groups(JOB, 4, version=0, max_len=8)
    _run(module_dir / "lora1", groups, tiny_model_dir, (1, 2), trainer=LORA)
    _run(module_dir / "lora-fsdp2-then-1", groups, tiny_model_dir, (2, 1), (1, 2),
         trainer={**LORA, "parallelism": "fsdp"}, model={"gradientCheckpointing": True})
    _run(module_dir / "lora-ddp2", groups, tiny_model_dir, (2, 2), trainer={**LORA, "parallelism": "ddp"})
    return {name: module_dir / name for name in ("lora1", "lora-fsdp2-then-1", "lora-ddp2")}


@pytest.mark.slow
@pytest.mark.parametrize("other", ["lora-fsdp2-then-1", "lora-ddp2"])
def test_lora_on_two_gloo_processes_matches_one_process(lora_runs: dict[str, Path], other: str) -> None:
    from safetensors.torch import load_file

    from asyncrl.infra.peft_adapters import ADAPTER_WEIGHTS

    one, two = read_jsonl(lora_runs["lora1"] / "metrics.jsonl"), read_jsonl(lora_runs[other] / "metrics.jsonl")
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    a1 = load_file(lora_runs["lora1"] / "weights" / "v2" / ADAPTER_WEIGHTS)
    a2 = load_file(lora_runs[other] / "weights" / "v2" / ADAPTER_WEIGHTS)
    assert a1.keys() == a2.keys() and all(".lora_" in k for k in a1)
    update = sum(float((a1[k] ** 2).sum()) for k in a1 if "lora_B" in k) ** 0.5  # (B starts at 0)
    diff = sum(float(((a1[k] - a2[k]) ** 2).sum()) for k in a1) ** 0.5
    assert update > 0 and diff < 0.02 * update, (diff, update)
    checkpoint = sorted((lora_runs[other] / "checkpoints").glob("step-*"))[-1]
    assert json.loads((checkpoint / "state.json").read_text())["identity"]["lora"]["rank"] == 8
