"""List a job's dead letters: the trajectory groups refused for training, with the reason for each.

A group that does not decode, or decodes but cannot be trained (a NaN logprob, lengths that
disagree, a reward out of range: asyncrl/transport/content.py), goes to the job's dead-letter
stream with its raw bytes instead of crashing the trainer; its admission slot is given back. So
does a group whose reward could not be computed (spec.reward.onError drop), filed by the rollout
worker that generated it instead of publishing it (kind "reward failed").
This command reads that stream from the job's Redis (on a cluster: `kubectl port-forward` the
job's Redis Service, the password is in the job's Redis Secret, and the uid is
`kubectl get asyncrljob NAME -o jsonpath='{.metadata.uid}'`). It prints a table and a summary
by reason, or one JSON object with --json; --save DIR writes each raw payload to DIR/<entry id>.bin
for a closer look (`asyncrl.transport.wire.decode_group` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("job", help="the AsyncRLJob's name (metadata.name)")
    parser.add_argument("--redis-url", default=None,
                        help=f"the job's Redis (default: $ASYNCRL_REDIS_URL, else {DEFAULT_REDIS_URL}); "
                             "redis://:PASSWORD@host:port/db")
    parser.add_argument("--uid", default=None,
                        help="the job's metadata.uid, part of every key on a cluster (default: $ASYNCRL_JOB_UID; "
                             "none for local runs)")
    parser.add_argument("--count", type=int, default=100, help="list at most this many, oldest first (default 100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, metavar="DIR", help="write each raw payload to DIR/<entry id>.bin")


def main(args: argparse.Namespace) -> int:
    if args.count < 1:
        print("error: --count must be >= 1", file=sys.stderr)
        return 2
    from asyncrl.infra.errors import TransportError

    try:
        found = asyncio.run(read(args.redis_url or os.environ.get("ASYNCRL_REDIS_URL") or DEFAULT_REDIS_URL,
                                 args.job, args.uid if args.uid is not None else os.environ.get("ASYNCRL_JOB_UID", ""),
                                 args.count))
    except (TransportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total, letters = found
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        for letter in letters:
            (args.save / f"{letter['entry_id']}.bin").write_bytes(letter.pop("payload"))
    for letter in letters:
        letter.pop("payload", None)
    summary = dict(Counter(letter["kind"] for letter in letters))
    if args.json:
        print(json.dumps({"job": args.job, "total": total, "shown": len(letters), "by_kind": summary,
                          "dead_letters": letters}))
    else:
        print_table(args.job, total, letters, summary)
    return 0


async def read(url: str, job: str, uid: str, count: int) -> tuple[int, list[dict[str, Any]]]:
    """(how many dead letters the job has, the oldest `count` of them as plain dicts)."""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from asyncrl.transport.streams import read_dead_letters

    names = StreamNames.for_job(job, uid)
    redis = await connect(url, timeout=10, outage_s=5, health=None)
    try:
        total = int(await redis.xlen(names.dead_letter))
        letters = await read_dead_letters(redis, names, count=count)
    finally:
        await redis.aclose()
    return total, [describe(letter) for letter in letters]


def describe(letter: Any) -> dict[str, Any]:
    """One dead letter as a plain dict: what it was (if its payload still decodes) and why it was refused."""
    from asyncrl.transport.streams import EPISODE_FAILED, REWARD_FAILED, UNTRAINABLE
    from asyncrl.transport.wire import WireFormatError, decode_group

    kinds = (UNTRAINABLE, REWARD_FAILED, EPISODE_FAILED)
    kind = next((k for k in kinds if letter.error.startswith(f"{k}:")), "undecodable")
    group_id = prompt_id = engine_id = None
    try:
        group = decode_group(letter.payload)
        group_id, prompt_id, engine_id = group.group_id, group.prompt_id, group.engine_id
    except (WireFormatError, ValueError, TypeError):
        pass
    return {"entry_id": letter.entry_id, "time": letter.time, "kind": kind, "reason": letter.error,
            "source_entry": letter.source_id, "consumer": letter.consumer, "group_id": group_id,
            "prompt_id": prompt_id, "engine_id": engine_id, "bytes": len(letter.payload), "payload": letter.payload}


def print_table(job: str, total: int, letters: list[dict[str, Any]], summary: dict[str, int]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not letters:
        console.print(f"job {job}: no dead letters")
        return
    table = Table(title=f"dead letters of {job}", show_header=True)
    for column in ("entry", "time (UTC)", "kind", "reason", "group", "engine", "bytes"):
        table.add_column(column, overflow="fold")
    for letter in letters:
        when = dt.datetime.fromtimestamp(letter["time"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(letter["entry_id"], when, letter["kind"], letter["reason"], letter["group_id"] or "-",
                      letter["engine_id"] or "-", str(letter["bytes"]))
    console.print(table)
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(summary.items()))
    console.print(f"{total} dead letter(s) in total; shown {len(letters)}: {kinds}")
