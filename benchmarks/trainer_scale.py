"""Peak memory and step time per trainer rank: FSDP2 against DDP, on the same model and batch.

Each parallelism runs in its own `torchrun` launch of this script (`--worker`), `--world` ranks,
the trainer's real step (`Trainer.train_step`: plan, micro-batches, decoupled loss, clipping,
AdamW) on one synthetic batch of trajectory groups, `--steps` times. Per rank it records the peak
memory of the training steps (CUDA: `max_memory_allocated`; CPU: the resident high-water mark
above the resident size before the model was built, reset after the model is built and freed
memory returned to the system: /proc/self/clear_refs, malloc_trim) and the bytes of parameters + optimizer
state it holds. FSDP keeps float32 master weights and computes in `--dtype`; DDP trains in
`--dtype` itself (as the trainer does). Prints one JSON object:

  fsdp_peak_over_ddp     peak memory of an FSDP rank / of a DDP rank (the larger rank of each)
  fsdp_state_over_ddp    parameters + optimizer state held per rank, the same ratio
  fsdp_step_over_ddp     median step seconds, the same ratio
  loss_rel_diff          |loss FSDP - loss DDP| / |loss DDP| of the first step (same weights, data)

  python benchmarks/trainer_scale.py                               # 2 gloo ranks, SmolLM2-135M, CPU
  python benchmarks/trainer_scale.py --device cuda --world 1 --arch qwen2-1.5b --dtype bfloat16

With one GPU (`--world 1`) nothing is sharded away: the figures then compare FSDP2's mixed
precision (float32 master, bfloat16 compute) with training in bfloat16, not the sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_figures
from proximal_cost import ARCHS, build_model  # (the random-initialised architectures: one table)

PARALLELISMS = ("fsdp", "ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (torchrun --nproc-per-node); default 2")
    p.add_argument("--steps", type=int, default=3, help="training steps per parallelism (the first is warm-up)")
    p.add_argument("--groups", type=int, default=4, help="trajectory groups in the batch")
    p.add_argument("--group-size", type=int, default=4, help="samples per group")
    p.add_argument("--tokens", type=int, default=128, help="response tokens per sample")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per group")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="spec.algorithm.microBatchTokens")
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="model path (ignored with --arch)")
    p.add_argument("--arch", choices=sorted(ARCHS), default=None, help="random-initialised architecture instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="spec.model.dtype")
    p.add_argument("--gradient-checkpointing", action="store_true", help="spec.model.gradientCheckpointing")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=PARALLELISMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.world, args.steps, args.groups, args.group_size, args.tokens) < 1:
        p.error("--world, --steps, --groups, --group-size and --tokens must be >= 1")
    return args


def job_for(args: argparse.Namespace, parallelism: str) -> Any:
    from asyncrl.api.spec import AsyncRLJob

    return AsyncRLJob.model_validate({
        "apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob", "metadata": {"name": "scale"},
        "spec": {
            "model": {"path": args.model, "dtype": args.dtype, "gradientCheckpointing": args.gradient_checkpointing},
            "dataset": {"source": "builtin:arithmetic"}, "reward": {"function": "exact-number"},
            "algorithm": {"groupSize": args.group_size, "batchSize": args.groups, "minibatches": 1,
                          "maxNewTokens": args.tokens, "microBatchTokens": args.micro_batch_tokens},
            "rollout": {"engine": "hf", "gpusPerReplica": 0},
            "trainer": {"device": args.device, "parallelism": parallelism, "gpusPerReplica": 0},
        },
    })


def synthetic_groups(args: argparse.Namespace, vocab: int) -> list[Any]:
    """Random prompts and responses, behaviour log-probs near the uniform policy's, rewards 0/1."""
    import numpy as np

    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    rng = np.random.default_rng(args.seed)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, args.prompt_tokens).astype(np.int32)
        samples = [TrajectorySample(i, rng.integers(0, vocab, args.tokens).astype(np.int32),
                                    (-np.log(vocab) + rng.normal(0, 0.1, args.tokens)).astype(np.float32),
                                    np.zeros(args.tokens, np.int32), float(i % 2), "length")
                   for i in range(args.group_size)]
        groups.append(TrajectoryGroup("scale", f"g{g}", f"p{g}", prompt, samples, "bench", 0.0, 0.0))
    return groups


def _reset_cpu_peak() -> None:
    """Return freed heap to the system (the full model FSDP loaded before sharding it), then
    restart the resident high-water mark from the current size."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _cpu_memory(field: str) -> int:
    """VmRSS (now) or VmHWM (high-water mark) of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def held_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of this rank's parameters and optimizer state (its shards under FSDP)."""
    from asyncrl.trainer.distributed import local_tensor

    params = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    state = sum(local_tensor(t).numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if hasattr(t, "element_size") and t.dim() > 0)
    return params + state


def worker(args: argparse.Namespace) -> None:
    """One rank of one parallelism: build, train `--steps` steps, write its figures."""
    import torch
    import torch.distributed as dist

    from asyncrl.infra.hf_models import torch_dtype
    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    torch.set_num_threads(args.threads)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    # A process group even for one rank: FSDP2 then runs its real (one-rank) mesh.
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    ctx = D.DistContext(rank=rank, world_size=world, local_rank=local, device=device, backend=dist.get_backend(),
                        object_group=dist.new_group(backend="gloo") if args.device == "cuda" else None)
    job = job_for(args, args.worker)
    sharded = args.worker == "fsdp"
    baseline = 0 if args.device == "cuda" else _cpu_memory("VmRSS")  # (torch, transformers: not the model)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.arch, "float32" if sharded else args.dtype, "cpu" if sharded else device,
                        args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if sharded:
        model = D.shard_model(model, ctx, torch_dtype(args.dtype))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if args.device == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    trainer = Trainer(job, RunConfig(engine_kind="hf"), ctx, model, optimizer, None)
    groups = synthetic_groups(args, D.unwrap(model).config.vocab_size)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_cpu_peak()
    losses, seconds = [], []
    for _ in range(args.steps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        record = trainer.train_step(groups)
        sync()
        seconds.append(time.perf_counter() - t0)
        losses.append(record.loss)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else _cpu_memory("VmHWM") - baseline
    figures = {"rank": rank, "peak_bytes": peak, "held_bytes": held_bytes(model, optimizer),
               "step_s": seconds, "losses": losses, "tokens": record.tokens}
    Path(args.out, f"{args.worker}-{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, parallelism: str, out: Path) -> list[dict[str, Any]]:
    """One torchrun launch of `parallelism`; each rank's figures."""
    from asyncrl.infra.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.world}",
           f"--master-port={free_port()}", __file__, *sys.argv[1:], "--worker", parallelism, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{parallelism} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{parallelism}: {args.world} rank(s), {time.time() - started:.0f}s", file=sys.stderr)
    return [json.loads(Path(out, f"{parallelism}-{r}.json").read_text()) for r in range(args.world)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="trainer-scale-") as tmp:
        ranks = {p: launch(args, p, Path(tmp)) for p in PARALLELISMS}
    peak = {p: max(r["peak_bytes"] for r in rs) for p, rs in ranks.items()}
    held = {p: max(r["held_bytes"] for r in rs) for p, rs in ranks.items()}
    step = {p: statistics.median(rs[0]["step_s"][1:] or rs[0]["step_s"]) for p, rs in ranks.items()}
    loss = {p: rs[0]["losses"][0] for p, rs in ranks.items()}
    gib = 1 << 30
    result = {
        "fsdp_peak_over_ddp": round(peak["fsdp"] / peak["ddp"], 4),
        "fsdp_state_over_ddp": round(held["fsdp"] / held["ddp"], 4),
        "fsdp_step_over_ddp": round(step["fsdp"] / step["ddp"], 4),
        "loss_rel_diff": abs(loss["fsdp"] - loss["ddp"]) / max(abs(loss["ddp"]), 1e-12),
        "fsdp_peak_gib": round(peak["fsdp"] / gib, 3), "ddp_peak_gib": round(peak["ddp"] / gib, 3),
        "fsdp_state_gib": round(held["fsdp"] / gib, 3), "ddp_state_gib": round(held["ddp"] / gib, 3),
        "fsdp_step_s": round(step["fsdp"], 4), "ddp_step_s": round(step["ddp"], 4),
        "fsdp_loss": loss["fsdp"], "ddp_loss": loss["ddp"],
        "peak_measure": "cuda max_memory_allocated" if args.device == "cuda" else "resident high-water (VmHWM)",
        "world": args.world, "steps": args.steps, "tokens_per_step": ranks["ddp"][0]["tokens"],
        "model": args.arch or args.model, "device": args.device, "dtype": args.dtype,
        "gradient_checkpointing": args.gradient_checkpointing, "threads_per_rank": args.threads,
        **machine_figures(load_start),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
