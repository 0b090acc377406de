"""Collective weight sync against disk, and both against the raw safetensors write+read of the same bytes.

Real hf engine servers (`asyncrl engine`, one process each, as rollout pods are) serve the model;
this process is the trainer's rank 0. Each repetition publishes a new version (every parameter
shifted) with the trainer's own writer (trainer/weights/files.py `write_weights`), then loads it into
every engine through the trainer's own `update_engines` (pause, load, label, resume), once per
transport on the same directory:

  disk        every engine reads weights/vN from the volume (`/update_weights_from_disk`)
  collective  rank 0 reads vN back (page cache) and broadcasts it over gloo in buckets
              (`/update_weights_from_distributed`); the group is formed once, before timing
  raw         the floor on disk: `safetensors.save_file` of the same tensors (fsynced) + one
              `load_file` per engine, in this process

Repetitions alternate which transport goes first; figures are medians. Prints one JSON object
(progress on stderr):

  collective_over_disk          engine update seconds, collective / disk (same weights, same engines)
  publish_collective_over_disk  the same with the version's write included (both transports write it:
                                disk serves late joiners and failures)
  disk_over_raw                 (write + disk update) / raw write+read
  collective_over_raw           (write + collective update) / raw write+read

  python benchmarks/weight_sync.py                   # SmolLM2-135M fp32 on CPU, 1 engine
  python benchmarks/weight_sync.py --engines 2 --reps 5
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

from rollout import MODEL, start_engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=1, help="hf engine servers to update")
    p.add_argument("--model", default=MODEL, help=f"model served and published (default {MODEL})")
    p.add_argument("--reps", type=int, default=3, help="timed versions per transport (median)")
    p.add_argument("--bucket-mb", type=int, default=256, help="collective bucket size (MiB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the published weights (spec model.dtype)")
    args = p.parse_args(argv)
    if min(args.engines, args.reps, args.bucket_mb) < 1:
        p.error("--engines, --reps and --bucket-mb must be >= 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def raw_write_read(tensors: dict[str, Any], folder: Path) -> tuple[float, float]:
    """Seconds to save the tensors in one safetensors file and fsync it, and to read it back into memory."""
    import os

    from safetensors.torch import load_file, save_file

    path = folder / "raw.safetensors"
    start = time.perf_counter()
    save_file(tensors, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    written = time.perf_counter()
    copies = [t.clone() for t in load_file(str(path)).values()]  # every byte read (the mapping is lazy)
    read = time.perf_counter()
    del copies
    path.unlink()
    return written - start, read - written


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, torch_dtype
    from asyncrl.infra.net import free_port
    from asyncrl.trainer.weights.broadcast import CollectiveSync
    from asyncrl.trainer.weights.engine_update import update_engines
    from asyncrl.trainer.weights.files import published_tensors, weights_path, write_weights

    procs: list[subprocess.Popen] = []
    sync = CollectiveSync(address="127.0.0.1", port=free_port(), backend="gloo", timeout_s=300,
                          bucket_bytes=args.bucket_mb << 20)
    try:
        urls = []
        for i in range(args.engines):
            proc, url = start_engine("hf", work, args.model)
            procs.append(proc)
            urls.append(url)
            log(f"engine {i} at {url}")
        model = load_causal_lm(args.model, dtype="float32", device="cpu")
        tokenizer = load_tokenizer(args.model)
        dtype = torch_dtype(args.dtype)
        weights = work / "weights"
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in published_tensors(model)}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

        from asyncrl.transport.versions import EngineInfo

        def engines() -> list[EngineInfo]:
            return [EngineInfo(engine_id=f"e{i}", url=u, weight_version=None, ready=True, heartbeat=time.time(),
                               incarnation="bench") for i, u in enumerate(urls)]

        def publish(version: int) -> float:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            start = time.perf_counter()
            write_weights(model, tokenizer, weights, version, dtype=dtype)
            return time.perf_counter() - start

        async def load(version: int, transport: str) -> float:
            start = time.perf_counter()
            result = await update_engines("hf", engines(), weights_path(weights, version), version, timeout_s=300,
                                          collective=sync if transport == "collective" else None)
            assert result.engines == args.engines
            return time.perf_counter() - start

        publish(1)  # warm-up: the group formed, both paths run once, untimed
        await load(1, "collective")
        await load(1, "disk")
        assert sync.stats.groups_formed == 1
        times: dict[str, list[float]] = {"write": [], "disk": [], "collective": [], "raw_write": [], "raw_read": []}
        for rep in range(args.reps):
            version = rep + 2
            times["write"].append(publish(version))
            order = ("disk", "collective") if rep % 2 == 0 else ("collective", "disk")
            for transport in order:
                times[transport].append(await load(version, transport))
            raw_write, raw_read = raw_write_read(tensors, work)
            times["raw_write"].append(raw_write)
            times["raw_read"].append(raw_read)
            log(f"rep {rep + 1}/{args.reps}: write {times['write'][-1]:.3f}s disk {times['disk'][-1]:.3f}s "
                f"collective {times['collective'][-1]:.3f}s raw write {raw_write:.3f}s read {raw_read:.3f}s")
        assert sync.stats.groups_formed == 1 and sync.stats.disk_fallbacks == 0, sync.stats
        med = {k: statistics.median(v) for k, v in times.items()}
        med["raw"] = med["raw_write"] + med["raw_read"] * args.engines  # one write, one read per engine
        return {
            "model": args.model, "dtype": args.dtype, "bytes": nbytes, "engines": args.engines, "reps": args.reps,
            "bucket_mb": args.bucket_mb, "write_s": round(med["write"], 4), "disk_update_s": round(med["disk"], 4),
            "collective_update_s": round(med["collective"], 4), "raw_write_s": round(med["raw_write"], 4),
            "raw_read_s": round(med["raw_read"], 4), "raw_write_read_s": round(med["raw"], 4),
            "collective_over_disk": round(med["collective"] / med["disk"], 3),
            "publish_collective_over_disk": round((med["write"] + med["collective"]) / (med["write"] + med["disk"]), 3),
            "disk_over_raw": round((med["write"] + med["disk"]) / med["raw"], 3),
            "collective_over_raw": round((med["write"] + med["collective"]) / med["raw"], 3),
            "collective_gbps": round(nbytes * args.engines / med["collective"] / 1e9, 3),
        }
    finally:
        await sync.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    result.update(machine_figures(load_start))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
