"""LoRA against full fine-tuning on the same model and batch: weight sync, trainer step, memory.

Two modes train the same model on the same batch with the trainer's own step (`Trainer.train_step`,
packed sequences, decoupled loss with the log-linear proximal, AdamW):

  full   every weight trains (spec.trainer without lora)
  lora   spec.trainer.lora: rank `--rank`, alpha 2 x rank, every linear layer; the base frozen

Each mode's steps run in processes of their own (so their memory is their own), in the order full,
lora, lora, full: one untimed warm-up step, then `--reps` timed ones each. Then each mode publishes
versions with the trainer's writer (trainer/weights/files.py `write_weights`: the whole model, or the PEFT
adapter) and loads them into a real hf engine server of its own (`asyncrl engine`, as a rollout pod
runs it) with the trainer's `update_engines` (pause, load, label, resume); modes alternate which goes
first. Figures are
medians. Prints one JSON object (progress on stderr):

  lora_over_full_sync_bytes    bytes of one published version, LoRA / full
  lora_over_full_sync_s        seconds to write a version and load it into the engine, LoRA / full
  lora_over_full_step_s        seconds per training step, LoRA / full
  lora_over_full_peak_bytes    the step process's memory growth over the loaded model (CPU: resident
                               high-water mark; CUDA: peak allocated), LoRA / full
  lora_over_full_state_bytes   parameters + gradients + optimizer state held, LoRA / full

  python benchmarks/lora.py                         # SmolLM2-135M-Instruct fp32 on CPU, rank 16
  python benchmarks/lora.py --device cuda --arch qwen2-1.5b --dtype bfloat16 --groups 16 \\
      --max-response 1024 --micro-batch-tokens 8192  # (the step figures only: no engine on CUDA here)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_figures
from proximal_cost import load_model
from trainer_scale import _cpu_memory, _reset_cpu_peak
from trainer_step import add_step_args, check_step_args, make_groups, make_job

MODES = ("full", "lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(p, group_size=8, max_response=32, micro_batch_tokens=4096)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank, every linear layer)")
    p.add_argument("--no-sync", action="store_true", help="skip the weight sync figures (the steps only)")
    p.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_step_args(p, args)
    if args.rank < 1:
        p.error("--rank must be >= 1")
    if args.arch is not None and not args.no_sync:
        p.error("--arch has no weights to serve: add --no-sync (the step figures only)")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lora_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {"rank": args.rank, "alpha": 2 * args.rank}


def adapted(model: Any, args: argparse.Namespace) -> Any:
    from asyncrl.api.spec.lora import LoraSpec
    from asyncrl.trainer.lora import add_adapters

    return add_adapters(model, LoraSpec(**lora_fields(args)), base_model=args.arch or args.model, seed=args.seed)


def state_bytes(model: Any, optimizer: Any) -> int:
    """Parameters, gradients and optimizer state this process holds."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if hasattr(t, "element_size") and t.dim() > 0)
    return params + grads + state


def step_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode's training steps in this process: seconds, memory growth, state held."""
    import torch

    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.lora import trainable_parameters
    from asyncrl.trainer.run_config import RunConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_model(args)
    lora = args.worker == "lora"
    if lora:
        adapted(model, args)
    model.train()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_cpu_peak()
        base = _cpu_memory("VmRSS")
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-7)
    trainer = Trainer(make_job(args, True, {"lora": lora_fields(args)} if lora else None),
                      RunConfig(engine_kind="hf"), DistContext(device=args.device), model, optimizer, None)
    groups = make_groups(args, model.config.vocab_size)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    seconds = []
    for rep in range(args.reps + 1):  # (the first: warm-up, AdamW state created)
        sync()
        start = time.perf_counter()
        trainer.train_step(groups)
        sync()
        if rep:
            seconds.append(time.perf_counter() - start)
            log(f"{args.worker} step {rep}/{args.reps}: {seconds[-1]:.2f}s")
    peak = (torch.cuda.max_memory_allocated() if cuda else _cpu_memory("VmHWM")) - base
    return {"step_s_all": seconds, "peak_bytes": peak, "state_bytes": state_bytes(model, optimizer),
            "trainable_params": sum(p.numel() for p in trainable_parameters(model)),
            "params": sum(p.numel() for p in model.parameters())}


def steps(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each mode's step figures, from processes of its own, in the order full, lora, lora, full (a load
    that drifts during the run weighs on both modes alike); step seconds: the median of both processes'."""
    out: dict[str, dict[str, Any]] = {}
    argv = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    for mode in (*MODES, *reversed(MODES)):
        proc = subprocess.run([sys.executable, __file__, *argv, "--worker", mode], capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} step process failed ({proc.returncode})")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if mode in out:
            got["step_s_all"] = out[mode]["step_s_all"] + got["step_s_all"]
            got["peak_bytes"] = max(got["peak_bytes"], out[mode]["peak_bytes"])
        out[mode] = got
    for got in out.values():
        got["step_s"] = statistics.median(got["step_s_all"])
    return out


async def sync_figures(args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    """Each mode: bytes of a version, seconds to write it, seconds to load it into its engine."""
    import torch

    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, torch_dtype
    from asyncrl.trainer.lora import trainable_parameters
    from asyncrl.trainer.weights.engine_update import update_engines
    from asyncrl.trainer.weights.files import weights_path, write_weights
    from asyncrl.transport.versions import EngineInfo
    from rollout import start_engine

    procs: list[subprocess.Popen] = []
    try:
        models, urls = {}, {}
        for mode in MODES:
            (work / mode).mkdir()
            proc, urls[mode] = start_engine("hf", work / mode, args.model)
            procs.append(proc)
            model = load_causal_lm(args.model, dtype="float32", device="cpu")
            models[mode] = adapted(model, args) if mode == "lora" else model
        tokenizer = load_tokenizer(args.model)
        dtype = torch_dtype(args.dtype)
        figures: dict[str, dict[str, list[float]]] = {m: {"bytes": [], "write_s": [], "update_s": []} for m in MODES}

        async def publish(mode: str, version: int) -> None:
            model = models[mode]
            with torch.no_grad():
                for p in trainable_parameters(model):
                    p.add_(1e-3)
            weights = work / mode / "weights"
            start = time.perf_counter()
            path = write_weights(model, tokenizer if mode == "full" else None, weights, version, dtype=dtype)
            written = time.perf_counter()
            engine = EngineInfo(engine_id=mode, url=urls[mode], weight_version=None, ready=True,
                                heartbeat=time.time(), incarnation="bench")
            result = await update_engines("hf", [engine], weights_path(weights, version), version, timeout_s=300)
            assert result.engines == 1
            done = time.perf_counter()
            assert path is not None
            figures[mode]["bytes"].append(sum(f.stat().st_size for f in path.iterdir()))
            figures[mode]["write_s"].append(written - start)
            figures[mode]["update_s"].append(done - written)

        for mode in MODES:  # warm-up: the engine's first load (the LoRA engine injects its adapters)
            await publish(mode, 1)
        for mode in MODES:
            for key in figures[mode]:
                figures[mode][key].clear()
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES))):
                await publish(mode, rep + 2)
                f = figures[mode]
                log(f"{mode} publish {rep + 1}/{args.reps}: {f['bytes'][-1] / 1e6:.1f} MB, write "
                    f"{f['write_s'][-1]:.3f}s, engine update {f['update_s'][-1]:.3f}s")
        return {m: {k: statistics.median(v) for k, v in f.items()} for m, f in figures.items()}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(step_worker(args)))
        return 0
    load_start = load_average()
    step = steps(args)
    result: dict[str, Any] = {
        "lora_over_full_step_s": ratio(step["lora"]["step_s"], step["full"]["step_s"]),
        "lora_over_full_peak_bytes": ratio(step["lora"]["peak_bytes"], step["full"]["peak_bytes"]),
        "lora_over_full_state_bytes": ratio(step["lora"]["state_bytes"], step["full"]["state_bytes"]),
        **{f"{mode}_{k}": (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v] if isinstance(v, list)
                           else v) for mode in MODES for k, v in step[mode].items()},
    }
    if not args.no_sync:
        with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
            sync = asyncio.run(sync_figures(args, Path(tmp)))
        result.update({
            "lora_over_full_sync_bytes": ratio(sync["lora"]["bytes"], sync["full"]["bytes"]),
            "lora_over_full_sync_s": ratio(sync["lora"]["write_s"] + sync["lora"]["update_s"],
                                           sync["full"]["write_s"] + sync["full"]["update_s"]),
            **{f"{mode}_sync_{k}": round(v, 4) for mode in MODES for k, v in sync[mode].items()},
        })
    result.update({"rank": args.rank, "alpha": 2 * args.rank, "model": args.arch or args.model,
                   "device": args.device, "dtype": args.dtype, "reps": args.reps,
                   "sequences": args.groups * args.group_size, **machine_figures(load_start)})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
