"""Asynchronous (eta = 2) vs synchronous (eta = 0) RL on the same local job, same steps and seed.

Both runs use `asyncrl run --pin`: the engine and rollout worker on one half of the cores, the
trainer on the other (as if they were separate GPU pools, which is what asynchrony exploits: in
synchronous mode each pool idles while the other works). Both leave out the job's held-out
evaluation (`--no-evaluation`): the figures time training alone. From the trainer's metrics.jsonl:

  groups_per_s   groups trained per second over steps 2..N (step 1 includes start-up)
  train_s        compute + publish seconds per step; rollout_s: the rest of the step (the trainer
                 waiting for its batch, which in synchronous mode is the whole generation time)
  ceiling        (rollout + train) / max(rollout, train) of the synchronous run: the best speedup
                 that overlapping the two stages can give; efficiency = speedup / ceiling

Prints one JSON object. Usage:
  .venv/bin/python benchmarks/async_vs_sync.py [--job examples/local.yaml] [--steps 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(job: Path, eta: int, steps: int, seed: int, run_dir: Path, extra: list[str]) -> list[dict]:
    from asyncrl.local.runner import asyncrl_command

    cmd = [*asyncrl_command(), "run", str(job), "--eta", str(eta), "--max-steps", str(steps), "--seed", str(seed),
           "--run-dir", str(run_dir), "--pin", "--no-progress", "--no-evaluation", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run with eta={eta} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    print(f"eta={eta}: {steps} steps in {time.monotonic() - t0:.0f}s ({run_dir})", file=sys.stderr)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m for m in lines if "event" not in m]  # per-step lines only (eval results have an "event")


def figures(metrics: list[dict], batch_size: int) -> dict[str, float]:
    steady = metrics[1:] if len(metrics) > 2 else metrics
    span = metrics[-1]["time"] - metrics[0]["time"] if len(metrics) > 1 else metrics[0]["step_seconds"]
    groups = batch_size * (len(metrics) - 1) if len(metrics) > 1 else batch_size
    train = [m["compute_seconds"] + m["weight_sync_seconds"] for m in steady]
    rollout = [max(m["step_seconds"] - t, 0.0) for m, t in zip(steady, train)]
    q = max(len(metrics) // 4, 1)
    return {
        "groups_per_s": groups / span,
        "train_s_per_step": sum(train) / len(train),
        "rollout_s_per_step": sum(rollout) / len(rollout),
        "final_reward": sum(m["reward_mean"] for m in metrics[-q:]) / q,
        "max_staleness": max(m["staleness_max"] for m in metrics),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "local.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-eta", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None, help="keep the two run directories here")
    args, extra = parser.parse_known_args()

    from asyncrl.api.loader import load_job

    batch_size = load_job(args.job).spec.algorithm.batch_size
    base = args.out_dir or Path(tempfile.mkdtemp(prefix="async-vs-sync-"))
    base.mkdir(parents=True, exist_ok=True)
    sync = figures(run(args.job, 0, args.steps, args.seed, base / "sync", extra), batch_size)
    asyn = figures(run(args.job, args.async_eta, args.steps, args.seed, base / "async", extra), batch_size)
    r, t = sync["rollout_s_per_step"], sync["train_s_per_step"]
    ceiling = (r + t) / max(r, t, 1e-9)
    speedup = asyn["groups_per_s"] / sync["groups_per_s"]
    print(json.dumps({
        "job": str(args.job), "steps": args.steps, "seed": args.seed, "async_eta": args.async_eta,
        "batch_size": batch_size,
        "sync_groups_per_s": round(sync["groups_per_s"], 4),
        "async_groups_per_s": round(asyn["groups_per_s"], 4),
        "speedup": round(speedup, 3),
        "sync_rollout_s_per_step": round(r, 2),
        "sync_train_s_per_step": round(t, 2),
        "async_rollout_wait_s_per_step": round(asyn["rollout_s_per_step"], 2),
        "async_train_s_per_step": round(asyn["train_s_per_step"], 2),
        "ceiling": round(ceiling, 3),
        "efficiency": round(speedup / ceiling, 3),
        "sync_final_reward": round(sync["final_reward"], 4),
        "async_final_reward": round(asyn["final_reward"], 4),
        "max_staleness_seen": asyn["max_staleness"],
        "sync_max_staleness": sync["max_staleness"],
        "run_dirs": str(base),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
