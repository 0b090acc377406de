"""Where asynchrony pays: a multi-turn workload with slow tools, synchronous (eta 0) vs asynchronous
(eta 2), same job, steps and seed, in one run.

The job is examples/local-agent.yaml with benchmarks/episode_workload.py's episode (three model
turns around two calls of a tool that sleeps for a heavy-tailed time; generation is real), groups
of 4 (`--group-size`) and no held-out evaluation. Both runs use `asyncrl run --pin` (engine and
worker on one half of the cores, the trainer on the other, as two GPU pools). In synchronous mode
the trainer waits for the slowest episode of every batch; asynchronously it trains on finished
episodes while others wait on tools.

Per run, from the trainer's metrics.jsonl (steps 2..N; step 1 includes start-up):
  episodes_per_s        episodes trained per second (episodes_per_s_all_steps: over every step,
                        step 1's start-up and the asynchronous run's filling of its pipeline too)
  trained_tokens_per_s  tokens with loss trained per second (tool results and feedback are masked)
  trainer_idle          the share of each step the trainer waited for its batch (not computing or
                        publishing)
  tool_s, generate_s    mean time one episode spent in tool calls and in generation
and the ratios async / sync.

Prints one JSON object. Usage:
  .venv/bin/python benchmarks/episodes.py [--steps 6] [--seed 0] [--tool-median-s 1.5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from async_vs_sync import run  # noqa: E402  (benchmarks/ is not a package)


def workload_job(base: Path, out: Path, group_size: int = 4) -> tuple[Path, int, int]:
    """The benchmark's job file, derived from `base`; returns (path, batch size, group size)."""
    doc = yaml.safe_load(base.read_text())
    spec = doc["spec"]
    spec["algorithm"]["groupSize"] = group_size
    spec["rollout"].update(episode="episode_workload:tool_episode", tools=["episode_workload:lookup"],
                           episodeLimits={"maxTurns": 3, "maxTokens": 400}, maxConcurrentToolCalls=256,
                           toolTimeoutSeconds=60)
    spec.pop("evaluation", None)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out, spec["algorithm"]["batchSize"], spec["algorithm"]["groupSize"]


def episode_figures(metrics: list[dict[str, Any]], batch_size: int, group_size: int) -> dict[str, float]:
    """The run's figures over steps 2..N (all steps when there are two or fewer)."""
    steady = metrics[1:] if len(metrics) > 2 else metrics
    span = metrics[-1]["time"] - metrics[0]["time"] if len(metrics) > 1 else metrics[0]["step_seconds"]
    busy = [m["compute_seconds"] + m["weight_sync_seconds"] for m in steady]
    idle = [max(m["step_seconds"] - b, 0.0) / m["step_seconds"] for m, b in zip(steady, busy)]
    n = len(steady)
    return {
        "episodes_per_s": batch_size * group_size * (len(metrics) - 1 if len(metrics) > 1 else 1) / span,
        "trained_tokens_per_s": sum(m["tokens"] for m in (metrics[1:] if len(metrics) > 1 else metrics)) / span,
        "episodes_per_s_all_steps": batch_size * group_size * len(metrics) / sum(m["step_seconds"] for m in metrics),
        "trainer_idle": sum(idle) / n,
        "tool_s": sum(m["tool_seconds"] for m in steady) / n,
        "generate_s": sum(m["generate_seconds"] for m in steady) / n,
        "turns_mean": sum(m["turns_mean"] for m in steady) / n,
        "max_staleness": max(m["staleness_max"] for m in metrics),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "local-agent.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-eta", type=int, default=2)
    parser.add_argument("--tool-median-s", type=float, default=1.5, help="median tool latency (Pareto 1.5 tail)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--out-dir", type=Path, default=None, help="keep the job and both run directories here")
    args, extra = parser.parse_known_args()

    base = args.out_dir or Path(tempfile.mkdtemp(prefix="episodes-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    job, batch, group = workload_job(args.job, base / "job.yaml", args.group_size)
    # (the rollout worker imports episode_workload, and reads the tool's latency, from its environment)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["BENCH_EPISODE_TOOL_MEDIAN_S"] = str(args.tool_median_s)
    sync = episode_figures(run(job, 0, args.steps, args.seed, base / "sync", extra), batch, group)
    asyn = episode_figures(run(job, args.async_eta, args.steps, args.seed, base / "async", extra), batch, group)
    out: dict[str, Any] = {"job": f"{args.job} + benchmarks/episode_workload.py", "steps": args.steps,
                           "seed": args.seed, "async_eta": args.async_eta, "tool_median_s": args.tool_median_s,
                           "batch_size": batch, "group_size": group}
    for name, figs in (("sync", sync), ("async", asyn)):
        out.update({f"{name}_{k}": round(v, 4) if isinstance(v, float) else v for k, v in figs.items()})
    out["episodes_per_s_ratio"] = round(asyn["episodes_per_s"] / sync["episodes_per_s"], 3)
    out["episodes_per_s_all_steps_ratio"] = round(
        asyn["episodes_per_s_all_steps"] / sync["episodes_per_s_all_steps"], 3)
    out["trained_tokens_per_s_ratio"] = round(asyn["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 3)
    out["tool_to_generate_ratio"] = round(sync["tool_s"] / max(sync["generate_s"], 1e-9), 3)
    out["run_dirs"] = str(base)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
