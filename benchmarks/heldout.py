"""Held-out accuracy of trained runs against the base model they started from, same prompts.

The baseline is the base model of the job (`spec.model.path`); each RUN_DIR is an `asyncrl run`
directory whose final weights (run.json `final_weights`) are evaluated with exactly the same
command, settings and prompts (`asyncrl eval --config JOB`: the job's `spec.evaluation`, greedy by
default). Both go through `asyncrl eval`, so this measures what a user would measure.

Prints one JSON object: the base model's figures, each run's, and the trained/base ratios of
pass@1 (mean, min, max over runs). Usage:
  .venv/bin/python benchmarks/heldout.py [--job examples/local.yaml] [--prompts N] RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def evaluate(model: str, job: Path, extra: list[str]) -> dict[str, Any]:
    """One `asyncrl eval` of `model` under `job`'s evaluation settings: its final JSON line."""
    from asyncrl.local.runner import asyncrl_command

    cmd = [*asyncrl_command(), "eval", model, "--config", str(job), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"asyncrl eval {model} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{model}: pass@1 {result['pass_at_1']:.3f} reward {result['reward_mean']:.3f} "
          f"({result['seconds']:.0f}s)", file=sys.stderr)
    return result


def final_weights(run_dir: Path) -> tuple[str, int]:
    """(final weights directory, seed) of a finished run."""
    info = json.loads((run_dir / "run.json").read_text())
    if not info.get("final_weights"):
        raise SystemExit(f"{run_dir}: run.json has no final_weights (did the run succeed?)")
    from asyncrl.api.loader import load_job

    return info["final_weights"], load_job(run_dir / "job.yaml").spec.seed


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="asyncrl run directories (with run.json)")
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "local.yaml",
                        help="job whose model and spec.evaluation define the baseline and the prompts")
    parser.add_argument("--prompts", type=int, default=None, help="override evaluation.prompts")
    args = parser.parse_args()
    extra = ["--prompts", str(args.prompts)] if args.prompts else []
    from asyncrl.api.loader import load_job

    base_model = load_job(args.job).spec.model.path
    base = evaluate(base_model, args.job, extra)
    runs = []
    for run_dir in args.runs:
        weights, seed = final_weights(run_dir)
        result = evaluate(weights, args.job, extra)
        runs.append({"run": str(run_dir), "seed": seed, "weights": weights, "pass_at_1": result["pass_at_1"],
                     "reward_mean": result["reward_mean"], "response_length": result["response_length"]})
    trained = [r["pass_at_1"] for r in runs]
    out = {
        "job": str(args.job),
        "prompts": base["prompts"], "samples_per_prompt": base["k"],
        "base": {"model": base_model, "pass_at_1": base["pass_at_1"], "reward_mean": base["reward_mean"],
                 "response_length": base["response_length"]},
        "runs": runs,
        "trained_pass_at_1": spread(trained),
        "trained_over_base_pass_at_1": (spread([t / base["pass_at_1"] for t in trained])
                                        if base["pass_at_1"] > 0 else None),
        "trained_minus_base_pass_at_1": spread([t - base["pass_at_1"] for t in trained]),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
