"""Trajectory transport throughput vs bare redis-py moving the same bytes, in the same run.

2 producer processes publish groups (default 8 samples x 1024 response tokens + 256 prompt
tokens); 1 consumer (this process) reads and acks them. "ours" = TrajectoryProducer.publish
(encode + XADD) and TrajectoryConsumer.read/ack (decode, dedupe, SADD+XACK+XDEL+XTRIM script);
"raw" = bare redis-py XADD / XREADGROUP / XACK of an opaque payload of the same size. Runs are
interleaved (raw, ours, raw, ours, ...) and medians compared, because this machine is shared.

Prints one JSON object: groups_per_s, mb_per_s, encode_us_per_group, decode_us_per_group,
ratio_vs_raw (ours / raw groups per second), and the figures behind them.

    .venv/bin/python benchmarks/transport.py              # starts a local Redis (AOF, appendfsync always)
    .venv/bin/python benchmarks/transport.py --redis-url redis://host:6379/0
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
import timeit
from pathlib import Path

import numpy as np

READY_KEY = "bench:{b}:ready"
GO_KEY = "bench:{b}:go"


def make_group(job: str, gid: str, samples: int, response_tokens: int, prompt_tokens: int, seed: int = 0):
    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    rng = np.random.default_rng(seed)
    return TrajectoryGroup(
        job=job, group_id=gid, prompt_id="prompt-0",
        prompt_ids=rng.integers(0, 50_000, prompt_tokens, dtype=np.int32),
        samples=[TrajectorySample(i, rng.integers(0, 50_000, response_tokens, dtype=np.int32),
                                  -rng.random(response_tokens, dtype=np.float32),
                                  np.full(response_tokens, 3, dtype=np.int32), 1.0, "length")
                 for i in range(samples)],
        engine_id="engine-0", created_at=time.time(), published_at=0.0)


# ------------------------------------------------------------------------------ producer process

async def produce(args: argparse.Namespace) -> None:
    import dataclasses

    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from asyncrl.transport.streams import TrajectoryProducer
    from asyncrl.transport.wire import encode_group

    r = await connect(args.url)
    names = StreamNames.for_job(args.job)
    template = make_group(args.job, "template", args.samples, args.response_tokens, args.prompt_tokens,
                          seed=args.seed)
    producer = TrajectoryProducer(r, names)
    raw_payload = encode_group(template)  # same byte volume for the raw baseline
    await r.rpush(READY_KEY, args.seed)
    await r.blpop([GO_KEY], timeout=120)
    for i in range(args.n):
        gid = f"p{args.seed}-{i}"
        if args.role == "ours":
            await producer.publish(dataclasses.replace(template, group_id=gid))
        else:
            await r.xadd(names.trajectories, {b"gid": gid.encode(), b"data": raw_payload})
    await r.aclose()


# ---------------------------------------------------------------------------------- one run

async def run_once(url: str, role: str, job: str, args: argparse.Namespace) -> dict:
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from asyncrl.transport.streams import TrajectoryConsumer

    r = await connect(url)
    names = StreamNames.for_job(job)
    await r.delete(READY_KEY, GO_KEY, *names.all_keys())
    consumer = TrajectoryConsumer(r, names, "bench-trainer")
    await consumer.ensure_group()
    total = 2 * args.groups_per_producer
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, __file__, "--role", role, "--url", url, "--job", job,
                               "--n", str(args.groups_per_producer), "--seed", str(i),
                               "--samples", str(args.samples), "--response-tokens", str(args.response_tokens),
                               "--prompt-tokens", str(args.prompt_tokens)],
                              env=env, cwd=tempfile.gettempdir()) for i in range(2)]
    try:
        for _ in procs:
            if not await r.blpop([READY_KEY], timeout=60):
                raise RuntimeError("producer did not start")
        await r.rpush(GO_KEY, 1, 1)
        start = time.perf_counter()
        done, nbytes = 0, 0
        while done < total:
            if role == "ours":
                got = await consumer.read(args.read_count, 1000)
                await consumer.ack(got)
                done += len(got)
            else:
                reply = await r.xreadgroup(names.consumer_group, "bench-trainer", {names.trajectories: ">"},
                                           count=args.read_count, block=1000)
                entries = reply[0][1] if reply else []
                if entries:
                    await r.xack(names.trajectories, names.consumer_group, *[e[0] for e in entries])
                    nbytes += sum(len(e[1][b"data"]) for e in entries)
                done += len(entries)
        elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"producer exited with {p.returncode}")
    await r.delete(*names.all_keys())
    await r.aclose()
    return {"role": role, "groups": total, "seconds": elapsed, "groups_per_s": total / elapsed}


def micro(args: argparse.Namespace) -> tuple[float, float, int]:
    from asyncrl.transport.wire import decode_group, encode_group

    g = make_group("bench", "g", args.samples, args.response_tokens, args.prompt_tokens)
    payload = encode_group(g)
    n = 300
    enc = min(timeit.repeat(lambda: encode_group(g), number=n, repeat=5)) / n
    dec = min(timeit.repeat(lambda: decode_group(payload), number=n, repeat=5)) / n
    return enc * 1e6, dec * 1e6, len(payload)


async def main_async(args: argparse.Namespace) -> dict:
    from asyncrl.local.redis_server import LocalRedis

    server = None
    tmp = None
    url = args.redis_url
    if not url:
        tmp = tempfile.TemporaryDirectory(prefix="asyncrl-bench-")
        server = LocalRedis(Path(tmp.name) / "redis", append_only=not args.no_aof).start()
        url = server.url
    try:
        enc_us, dec_us, payload_bytes = micro(args)
        runs = {"raw": [], "ours": []}
        for k in range(args.repeats):
            for role in ("raw", "ours"):
                res = await run_once(url, role, f"bench-{role}-{k}", args)
                runs[role].append(res["groups_per_s"])
    finally:
        if server:
            server.stop()
        if tmp:
            tmp.cleanup()
    ours, raw = statistics.median(runs["ours"]), statistics.median(runs["raw"])
    return {
        "groups_per_s": round(ours, 1),
        "mb_per_s": round(ours * payload_bytes / 1e6, 1),
        "encode_us_per_group": round(enc_us, 1),
        "decode_us_per_group": round(dec_us, 1),
        "ratio_vs_raw": round(ours / raw, 3),
        "raw_groups_per_s": round(raw, 1),
        "raw_mb_per_s": round(raw * payload_bytes / 1e6, 1),
        "payload_bytes_per_group": payload_bytes,
        "groups_per_run": 2 * args.groups_per_producer,
        "runs_groups_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "config": {"producers": 2, "consumers": 1, "samples": args.samples,
                   "response_tokens": args.response_tokens, "prompt_tokens": args.prompt_tokens,
                   "read_count": args.read_count, "repeats": args.repeats,
                   "redis": "external" if args.redis_url
                   else ("local, no AOF" if args.no_aof else "local, AOF always")},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting a local one")
    p.add_argument("--no-aof", action="store_true", help="local Redis without AOF (default: AOF, appendfsync always)")
    p.add_argument("--groups-per-producer", type=int, default=300)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-tokens", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--read-count", type=int, default=16, help="groups per XREADGROUP")
    p.add_argument("--repeats", type=int, default=3, help="interleaved raw/ours runs (median taken)")
    # internal: producer process
    p.add_argument("--role", choices=["ours", "raw"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        asyncio.run(produce(args))
        return 0
    print(json.dumps(asyncio.run(main_async(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
