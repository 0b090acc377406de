"""asyncrl vs Hugging Face TRL's synchronous GRPOTrainer on identical work: reward over steps and wall time.

Per seed, one at a time, trains the job (default examples/local.yaml) with:

  trl                     TRL 1.16 GRPOTrainer (benchmarks/trl_peer.py in .venv-trl: same weights, prompts
                          in the same order, reward, batch, sampling, AdamW; synchronous, on-policy)
  asyncrl-eta0            asyncrl run --eta 0 (synchronous asyncrl)
  asyncrl-eta2-loglinear  asyncrl run --eta 2 with the A-3PO log-linear proximal (examples/local.yaml as is)
  asyncrl-eta2-recompute  asyncrl run --eta 2 with algorithm.proximal recompute

asyncrl runs go through benchmarks/async_vs_sync.py's `run` (`asyncrl run --pin`: engine + rollout on
one half of the cores, trainer on the other). TRL runs in one process on all cores.

Clocks: TRL's starts at the trainer's on_train_begin (model loaded); asyncrl's at the earlier of the
trainer's step clock start (model and optimizer built) and the rollout worker's start, so generation
done while the trainer still loads counts. Start-up before that (imports, Redis, engine) is in
`process_s` for both.

Figures (printed as one JSON object): per system, the mean reward of the last quarter of steps (mean
over seeds, min, max, std), seconds per step, and time_to_target: per seed, the first wall-second at
which the 5-step moving average of reward reaches TRL's final 5-step moving average for that seed
(null if never), with trl_over_system = TRL's time / the system's time (> 1: faster than TRL).
Also the per-step reward of every seed, and a plot (moving-average reward, mean over seeds, vs step
and vs wall seconds; rendered by .venv-trl's matplotlib) at --plot.

Resumable: a system+seed whose result.json in --out has at least --steps steps is not run again
(a partial or shorter one is deleted and run afresh). The full run (3 seeds x 4 systems x 28 steps)
takes hours on 2 cores.

  .venv/bin/python benchmarks/vs_trl.py --seeds 0,1,2 --steps 28 [--systems trl,asyncrl-eta0]
      [--out runs/vs_trl] [--plot docs/vs_trl.png] [--job examples/local.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = Path(__file__).resolve().parent
TRL_VENV = REPO / ".venv-trl"
WINDOW = 5

SYSTEMS: dict[str, dict[str, Any]] = {
    "trl": {},
    "asyncrl-eta0": {"eta": 0, "proximal": None},
    "asyncrl-eta2-loglinear": {"eta": 2, "proximal": "loglinear"},
    "asyncrl-eta2-recompute": {"eta": 2, "proximal": "recompute"},
}
"""System name -> asyncrl overrides (eta; proximal, None = the job's own)."""

Record = dict[str, Any]
"""One optimizer step: step, wall_s (since the system's training start), reward_mean, completion_length."""


# ------------------------------------------------------------------------------ figures (pure)


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over `window` values; the first window - 1 points average what there is so far."""
    if window < 1:
        raise ValueError("window must be >= 1")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def effective_window(n: int, window: int = WINDOW) -> int:
    """The window used for targets: `window`, or all steps when a run is shorter."""
    return max(min(window, n), 1)


def final_moving_average(rewards: list[float], window: int = WINDOW) -> float | None:
    if not rewards:
        return None
    return moving_average(rewards, effective_window(len(rewards), window))[-1]


def time_to_target(records: list[Record], target: float | None, window: int = WINDOW) -> float | None:
    """The first wall_s at which the full-window moving average of reward is >= target (None: never)."""
    if target is None or not records:
        return None
    w = effective_window(len(records), window)
    ma = moving_average([r["reward_mean"] for r in records], w)
    for i in range(w - 1, len(records)):
        if ma[i] >= target - 1e-12:
            return float(records[i]["wall_s"])
    return None


def last_quarter(values: list[float]) -> float | None:
    """Mean of the last quarter of the values (at least one), as run.json's reward_last_quarter."""
    if not values:
        return None
    q = max(len(values) // 4, 1)
    return sum(values[-q:]) / q


def spread(values: list[float | None], digits: int = 4) -> dict[str, Any]:
    """mean/min/max/std (sample std; 0 for one value) of the non-null values, and the per-seed list."""
    vals = [v for v in values if v is not None]
    r = (lambda x: None if x is None else round(x, digits))  # noqa: E731
    if not vals:
        return {"mean": None, "min": None, "max": None, "std": None, "per_seed": [r(v) for v in values]}
    return {"mean": r(statistics.fmean(vals)), "min": r(min(vals)), "max": r(max(vals)),
            "std": r(statistics.stdev(vals) if len(vals) > 1 else 0.0), "per_seed": [r(v) for v in values]}


def s_per_step(records: list[Record]) -> float | None:
    """Wall seconds per step from the clock start to the last step (start-up of step 1 included)."""
    return records[-1]["wall_s"] / len(records) if records else None


def s_per_step_steady(records: list[Record]) -> float | None:
    """Seconds per step over steps 2..N (None with one step)."""
    if len(records) < 2:
        return None
    return (records[-1]["wall_s"] - records[0]["wall_s"]) / (len(records) - 1)


def records_from_metrics(metrics: list[dict[str, Any]], rollout_start: float | None = None) -> list[Record]:
    """asyncrl metrics.jsonl lines -> step records on asyncrl's clock.

    The clock starts at the trainer's first step clock (`time - step_seconds` of step 1: the Trainer
    was built, model and optimizer loaded), or at `rollout_start` (unix time the rollout worker was
    started) when that is earlier."""
    if not metrics:
        return []
    t0 = metrics[0]["time"] - metrics[0]["step_seconds"]
    if rollout_start is not None:
        t0 = min(t0, rollout_start)
    return [{"step": m["step"], "wall_s": round(m["time"] - t0, 3), "reward_mean": m["reward_mean"],
             "completion_length": m.get("response_length"), "staleness_mean": m.get("staleness_mean")}
            for m in metrics]


def summarize(results: dict[str, dict[int, dict[str, Any]]], seeds: list[int], window: int = WINDOW,
              reference: str = "trl") -> dict[str, Any]:
    """The named figures from {system: {seed: {"records": [...], "process_s": ...}}}.

    The target of seed s is `reference`'s final moving average for s; trl_over_system is the
    reference's time to its own target over the system's time, per seed, and over the seeds where
    both reached it (ratio of the means)."""
    ref = results.get(reference, {})
    targets = {s: final_moving_average([r["reward_mean"] for r in ref[s]["records"]], window) if s in ref else None
               for s in seeds}
    ref_ttt = {s: time_to_target(ref[s]["records"], targets[s], window) if s in ref else None for s in seeds}
    systems: dict[str, Any] = {}
    per_step: dict[str, dict[str, list[float]]] = {}
    for name, by_seed in results.items():
        done = [s for s in seeds if s in by_seed]
        recs = {s: by_seed[s]["records"] for s in done}
        ttt = [time_to_target(recs[s], targets[s], window) if s in recs else None for s in seeds]
        ratios = [ref_ttt[s] / t if (t and ref_ttt[s] is not None) else None for s, t in zip(seeds, ttt)]
        both = [(ref_ttt[s], t) for s, t in zip(seeds, ttt) if t and ref_ttt[s] is not None]
        systems[name] = {
            "seeds_done": done,
            "steps": [len(recs[s]) for s in done],
            "reward_last_quarter": spread([last_quarter([r["reward_mean"] for r in recs[s]]) if s in recs else None
                                           for s in seeds]),
            "reward_final_ma": spread([final_moving_average([r["reward_mean"] for r in recs[s]], window)
                                       if s in recs else None for s in seeds]),
            "s_per_step": spread([s_per_step(recs[s]) if s in recs else None for s in seeds], 2),
            "s_per_step_steady": spread([s_per_step_steady(recs[s]) if s in recs else None for s in seeds], 2),
            "train_wall_s": spread([recs[s][-1]["wall_s"] if recs.get(s) else None for s in seeds], 1),
            "process_s": spread([by_seed[s].get("process_s") if s in by_seed else None for s in seeds], 1),
            "load_average_start": spread([by_seed[s].get("load_average_start") if s in by_seed else None
                                          for s in seeds], 2),
            "time_to_target_s": {
                "per_seed": [None if t is None else round(t, 1) for t in ttt],
                "reached": f"{sum(t is not None for t in ttt)}/{len(done)}",
                "mean": round(statistics.fmean([t for t in ttt if t is not None]), 1)
                if any(t is not None for t in ttt) else None,
            },
            f"{reference}_over_system": {
                "per_seed": [None if r is None else round(r, 3) for r in ratios],
                "ratio_of_means": round(sum(a for a, _ in both) / sum(b for _, b in both), 3) if both else None,
            },
        }
        per_step[name] = {str(s): [round(r["reward_mean"], 3) for r in recs[s]] for s in done}
    return {
        "window": window,
        "target_per_seed": {str(s): None if targets[s] is None else round(targets[s], 4) for s in seeds},
        "target_definition": f"final {window}-step moving average of {reference}'s reward, per seed",
        "systems": systems,
        "reward_per_step": per_step,
    }


def compact_json(obj: Any, depth: int = 0, inline_from: int = 3) -> str:
    """JSON with one line per figure: objects nested `inline_from` deep (and every list) on one line."""
    if not isinstance(obj, dict) or not obj or depth >= inline_from:
        return json.dumps(obj)
    pad = "  " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {compact_json(v, depth + 1, inline_from)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"


def plot_series(results: dict[str, dict[int, dict[str, Any]]], window: int = WINDOW) -> dict[str, Any]:
    """Per system, over the seeds it has: step, mean wall_s and mean moving-average reward per step
    (up to the shortest seed's length)."""
    out = {}
    for name, by_seed in results.items():
        runs = [v["records"] for v in by_seed.values() if v["records"]]
        if not runs:
            continue
        n = min(len(r) for r in runs)
        mas = [moving_average([x["reward_mean"] for x in r[:n]], window) for r in runs]
        out[name] = {"seeds": len(runs),
                     "step": [runs[0][i]["step"] for i in range(n)],
                     "wall_s": [statistics.fmean(r[i]["wall_s"] for r in runs) for i in range(n)],
                     "reward_ma": [statistics.fmean(m[i] for m in mas) for i in range(n)]}
    return out


def render_plot(series: dict[str, Any], path: Path, title: str = "", window: int = WINDOW) -> None:
    """Two panels, moving-average reward vs step and vs wall seconds (needs matplotlib: .venv-trl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for name, s in series.items():
        label = f"{name} ({s['seeds']} seed{'s' if s['seeds'] != 1 else ''})"
        by_step.plot(s["step"], s["reward_ma"], marker="o", markersize=3, label=label)
        by_time.plot(s["wall_s"], s["reward_ma"], marker="o", markersize=3, label=label)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "wall seconds since training start")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward, {window}-step moving average (mean over seeds)")
        ax.grid(alpha=0.3)
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_step.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ running


def run_dir(out: Path, system: str, seed: int) -> Path:
    return out / system / f"seed{seed}"


def load_result(out: Path, system: str, seed: int, steps: int, job: Path | None = None) -> dict[str, Any] | None:
    """The stored result of a system+seed with at least `steps` steps (records cut to `steps`) of `job`
    (when given), or None."""
    d = run_dir(out, system, seed)
    try:
        result = json.loads((d / "result.json").read_text())
        records = [json.loads(line) for line in (d / "steps.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if len(records) < steps or (job is not None and result.get("source_job", str(job)) != str(job)):
        return None
    return {"records": records[:steps], "process_s": result.get("process_s"),
            "load_average_start": (result.get("load_average") or {}).get("start"), "result": result}


def derived_job(job: Path, proximal: str | None, dest: Path) -> Path:
    """The job file with algorithm.proximal set (validated by asyncrl's loader); `job` when unchanged."""
    import yaml

    from asyncrl.loader import load_job

    if proximal is None or load_job(job).spec.algorithm.proximal == proximal:
        return job
    data = yaml.safe_load(job.read_text())
    data.setdefault("spec", {}).setdefault("algorithm", {})["proximal"] = proximal
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    load_job(dest)
    return dest


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        print("vs_trl: .venv-trl is missing; running scripts/setup-trl.sh", file=sys.stderr, flush=True)
        subprocess.run(["bash", str(REPO / "scripts" / "setup-trl.sh")], cwd=REPO, check=True, stdout=sys.stderr)
    return python


def run_trl(job: Path, seed: int, steps: int, d: Path, threads: int | None = None) -> dict[str, Any]:
    python = ensure_trl_venv()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    cmd = [str(python), str(BENCHMARKS / "trl_peer.py"), "--job", str(job), "--seed", str(seed),
           "--steps", str(steps), "--out", str(d)] + (["--threads", str(threads)] if threads else [])
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=sys.stderr)  # its progress lines pass through
    if proc.returncode != 0:
        raise SystemExit(f"vs_trl: the TRL run (seed {seed}) failed with exit code {proc.returncode}: {' '.join(cmd)}")
    result = json.loads((d / "result.json").read_text())
    result["process_s"] = round(time.monotonic() - t0, 1)
    return result


def run_asyncrl(job: Path, eta: int, seed: int, steps: int, d: Path) -> dict[str, Any]:
    sys.path.insert(0, str(BENCHMARKS))
    from async_vs_sync import run  # the asyncrl side of the existing benchmark: `asyncrl run --pin`

    t0 = time.monotonic()
    metrics = run(job, eta, steps, seed, d / "run", [])
    process_s = time.monotonic() - t0
    procs = d / "run" / "processes.json"  # rewritten when the rollout workers start (asyncrl/runner.py)
    rollout_start = procs.stat().st_mtime if procs.exists() else None
    records = records_from_metrics(metrics, rollout_start)
    with (d / "steps.jsonl").open("w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return {"job": str(job), "eta": eta, "seed": seed, "steps": len(records), "run_dir": str(d / "run"),
            "process_s": round(process_s, 1), "wall_s": records[-1]["wall_s"] if records else None,
            "rollout_started_first": rollout_start is not None and bool(metrics)
            and rollout_start < metrics[0]["time"] - metrics[0]["step_seconds"]}


def run_system(system: str, job: Path, seed: int, steps: int, out: Path, trl_threads: int | None = None) -> None:
    d = run_dir(out, system, seed)
    if d.exists():
        shutil.rmtree(d)  # a partial or shorter attempt: start afresh (a resumed run's clock means nothing)
    d.mkdir(parents=True)
    print(f"vs_trl: {system} seed {seed}: {steps} steps ({d})", file=sys.stderr, flush=True)
    load_start = os.getloadavg()[0]
    if system == "trl":
        result = run_trl(job, seed, steps, d, trl_threads)
    else:
        o = SYSTEMS[system]
        result = run_asyncrl(derived_job(job, o["proximal"], out / system / "job.yaml"), o["eta"], seed, steps, d)
    result["system"] = system
    result["source_job"] = str(job)
    result["load_average"] = {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)}
    (d / "result.json").write_text(json.dumps(result, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vs_trl.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "local.yaml")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "vs_trl", help="results (default runs/vs_trl)")
    parser.add_argument("--plot", default=str(REPO / "docs" / "vs_trl.png"),
                        help="PNG path (default docs/vs_trl.png; '' = no plot)")
    parser.add_argument("--window", type=int, default=WINDOW, help="moving-average window (default 5)")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help="torch threads of the TRL process (default: torch's, one per core)")
    parser.add_argument("--render-plot", nargs=2, metavar=("SERIES_JSON", "PNG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render_plot:  # (run by .venv-trl's python, which has matplotlib)
        data = json.loads(Path(args.render_plot[0]).read_text())
        render_plot(data["series"], Path(args.render_plot[1]), data.get("title", ""), data.get("window", WINDOW))
        return 0

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    job, out = args.job.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for system in systems:
            if load_result(out, system, seed, args.steps, job) is not None:
                print(f"vs_trl: {system} seed {seed}: already in {out}, not run again", file=sys.stderr)
                continue
            run_system(system, job, seed, args.steps, out, args.trl_threads)

    results: dict[str, dict[int, dict[str, Any]]] = {}
    for system in systems + (["trl"] if "trl" not in systems else []):  # TRL sets the target
        by_seed = {s: r for s in seeds if (r := load_result(out, system, s, args.steps, job)) is not None}
        if by_seed or system in systems:
            results[system] = by_seed
    summary = summarize(results, seeds, args.window)
    figures = {"job": str(args.job), "steps": args.steps, "seeds": seeds, "out": str(out),
               "plot": args.plot or None, **summary}
    (out / "summary.json").write_text(json.dumps(figures, indent=2))
    if args.plot:
        title = f"{args.job.name}: {args.steps} steps, seeds {args.seeds}"
        write_plot(results, args.window, Path(args.plot).resolve(), out, title)
    print(compact_json(figures))
    return 0


def write_plot(results: dict[str, dict[int, dict[str, Any]]], window: int, png: Path, out: Path, title: str) -> None:
    series = plot_series(results, window)
    data = out / "plot_series.json"
    data.write_text(json.dumps({"series": series, "title": title, "window": window}))
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        print(f"vs_trl: no {python}: plot not drawn (series in {data})", file=sys.stderr)
        return
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--render-plot", str(data), str(png)],
                          cwd=REPO, stdout=sys.stderr)
    if proc.returncode != 0 or not png.exists():
        print(f"vs_trl: the plot could not be drawn (series in {data})", file=sys.stderr)
    else:
        print(f"vs_trl: plot written to {png}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
