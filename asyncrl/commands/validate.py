"""Check AsyncRLJob files. Prints one summary line per valid job; for every problem, the file, line,
field path, offending value and what is allowed. Exit 0 when all files are valid, 1 otherwise."""

from __future__ import annotations

import argparse
import sys

from asyncrl.api.loader import JobFileError, load_jobs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML files (several documents per file allowed)")


def main(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            jobs = load_jobs(path)
        except JobFileError as exc:
            failed = True
            for err in exc.errors:
                print(f"error: {err}", file=sys.stderr)
            continue
        for job in jobs:
            s = job.spec
            a = s.algorithm
            print(f"{path}: ok: {job.metadata.name}: model {s.model.path}, {s.rollout.replicas}x {s.rollout.engine} "
                  f"rollout, {s.trainer.replicas}x{s.trainer.gpus_per_replica} GPU trainer, loss {a.loss}"
                  f"{'/' + a.proximal if a.loss == 'decoupled' else ''}, eta {s.staleness.max_head_offpolicyness}, "
                  f"B={a.batch_size} n={a.group_size}, {s.trainer.max_steps} steps")
    return 1 if failed else 0
