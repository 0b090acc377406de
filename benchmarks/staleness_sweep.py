"""Which stabiliser for stale data to pick at which staleness: reward and wall time of short runs.

For each stabiliser x staleness level x seed, trains the job (default examples/local.yaml: the embedded
SmolLM2-135M-Instruct on builtin two-digit arithmetic) with `asyncrl run --pin` (benchmarks/async_vs_sync.py's
`run`; held-out evaluation off) and records the reward and wall second of every step.

Stabilisers (STABILISERS: overrides merged into the job's spec; the derived job is validated by asyncrl's
loader and written to the run's folder as job.yaml; one that fails validation is skipped with the
loader's error, in the JSON as {"skipped": reason}):
  default     the job as is (decoupled loss, A-3PO log-linear proximal)
  recompute   algorithm.proximal recompute (the exact proximal: one more forward per step)
  m2po        algorithm.m2.threshold 0.04 (M2PO's second-moment mask instead of the clip)
  bapo        algorithm.bapo {} (adaptive clip bounds)
  vcpo        algorithm.vcpo.essScaling true (learning rate scaled by the ESS of the behaviour weights)
  gspo        algorithm.objective gspo, clipEps 3e-4 / clipEpsHigh 4e-4 (the paper's sequence-level band)
  cispo       algorithm.objective cispo, clipEps 0.99 / clipEpsHigh 0.28 (no lower bound, as its paper)
  sapo        algorithm.objective sapo (soft gate; its temperatures at their defaults)
  roll-alpha  staleness.policy per-sample with asyncRatio = the staleness level (ROLL Flash); at a
              whole-number alpha it admits and drops exactly what global-budget does at eta = alpha
  tba         algorithm.objective tb with algorithm.replay {} (trajectory balance from a replay buffer)

Staleness s is forced, so that every batch really is that stale: staleness.maxHeadOffpolicyness s (for
roll-alpha: asyncRatio s) and trainer.weightSyncLag s, so the engines serve version v - s when v is
published. s = 0 is synchronous RL. Step k trains samples min(k - 1, s) versions old (the engines serve
version 0 until version s + 1 is published), so `staleness_after_lag` (steps after the first s) should
be s.

Figures (one JSON object; per stabiliser and staleness, mean/min/max/std over seeds):
  heldout_pass_at_1     the final policy's greedy pass@1 on --heldout-prompts (256) held-out prompts
                        (`asyncrl eval` of the run's final weights under the job's spec.evaluation,
                        as benchmarks/heldout.py): what the stabiliser trained, free of the lag
  reward_last_quarter   mean reward of the last quarter of steps (the training batches' reward: of
                        samples generated s versions earlier)
  reward_final_ma       final 5-step moving average of reward
  s_per_step            wall seconds per step (clock as benchmarks/vs_trl.py: start-up of step 1 included)
  time_to_target_s      per seed, the first wall second at which the 5-step moving average reaches the
                        target: `default` at staleness 0 of the same seed's final moving average
  sync_over_this        default@0's time to its own target / this time (> 1: there sooner than sync RL)
  staleness_mean        mean staleness of the trained tokens over all steps (trainer metrics.jsonl)
  staleness_after_lag   the same over steps s + 1 .. N: the proof that staleness s was forced
  recommendation        per staleness level, the stabiliser with the best heldout_pass_at_1
                        (reward_last_quarter with --heldout-prompts 0) on the seeds every stabiliser
                        has (selected_on_seeds), and whether its lead over `default` on the seeds the
                        two share (lead_on_seeds: a paired lead) exceeds the seed spread (the larger
                        std of the two); if it does not, "cannot separate at this scale". Run the
                        leaders on more seeds to confirm them. Why not the training reward: step k's
                        reward is that of policy k-1-s, so 12 steps at staleness 8 end on the
                        policies of updates 1-3, made at staleness <= 2
  machine               threads, cores, load average, torch and Python (benchmarks/machine.py)
The plot (--plot): one column per staleness level; above, the 5-step moving-average reward vs step,
mean over seeds, a line per stabiliser; below, the final policies' held-out pass@1, a bar per
stabiliser (mean) and a dot per seed; drawn by .venv-trl's matplotlib (or --plot-python's).

Disk: once a cell is measured (its final policy evaluated, result.json written), its run's weights/
and checkpoints/ (about 8 GB for 12 steps of the embedded model) are deleted; --keep-weights keeps them.

A sweep done over several sittings: --no-train summarises what --out holds for the grid given (the
cells not run yet are listed under "missing").

Resumable: a stabiliser+staleness+seed whose result.json in --out has at least --steps steps of the same
job and the same derived spec, and its held-out figure on the same number of prompts, is not run again
(a partial or different one is run afresh).

CPU (2 cores): default and tba (the objective that needs no correction for staleness) at staleness 0,
2 and 8, seeds 0 and 1, 12 steps: 12 runs of about 6-8 minutes each (the held-out evaluation of
the final policy included), about 90 minutes; others with --stabilisers.
  .venv/bin/python benchmarks/staleness_sweep.py
  .venv/bin/python benchmarks/staleness_sweep.py --stabilisers default,recompute --staleness 0,2 --seeds 0 \\
      --steps 6 --out runs/sweep_small --plot ''
GPU machine (--full): every stabiliser, seeds 0,1,2, 40 steps, trainer.device auto (the engine picks the
GPU itself): 10 x 3 x 3 = 90 runs (not yet timed on a GPU).
  python3 benchmarks/staleness_sweep.py --full [--out runs/staleness_sweep_full]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from heldout import evaluate, final_weights  # noqa: E402  (benchmarks/ is not a package)
from vs_trl import (  # noqa: E402
    TRL_VENV,
    WINDOW,
    compact_json,
    ensure_trl_venv,
    final_moving_average,
    last_quarter,
    load_result,
    plot_series,
    run_asyncrl,
    run_dir,
    s_per_step,
    spread,
    time_to_target,
)

STABILISERS: dict[str, dict[str, Any]] = {
    "default": {},
    "recompute": {"algorithm": {"proximal": "recompute"}},
    "m2po": {"algorithm": {"m2": {"threshold": 0.04}}},
    "bapo": {"algorithm": {"bapo": {}}},
    "vcpo": {"algorithm": {"vcpo": {"essScaling": True}}},
    "gspo": {"algorithm": {"objective": "gspo", "clipEps": 3e-4, "clipEpsHigh": 4e-4}},
    "cispo": {"algorithm": {"objective": "cispo", "clipEps": 0.99, "clipEpsHigh": 0.28}},
    "sapo": {"algorithm": {"objective": "sapo"}},
    "roll-alpha": {"staleness": {"policy": "per-sample"}},
    "tba": {"algorithm": {"objective": "tb", "replay": {}}},
}
"""Stabiliser -> overrides of the job's spec (YAML names; None deletes a key). The staleness fields
(maxHeadOffpolicyness or asyncRatio, weightSyncLag) are set per level by `staleness_overrides`."""

HELDOUT_PROMPTS = 256
"""Held-out prompts the final policy of each cell answers (greedy; the job's spec.evaluation otherwise)."""

REFERENCE = "default"
"""The stabiliser whose synchronous (staleness 0) run sets each seed's target."""

CPU_DEFAULTS: dict[str, Any] = {"stabilisers": "default,tba", "staleness": "0,2,8", "seeds": "0,1",
                                "steps": 12, "device": None}
FULL_DEFAULTS: dict[str, Any] = {"stabilisers": ",".join(STABILISERS), "staleness": "0,2,8", "seeds": "0,1,2",
                                 "steps": 40, "device": "auto"}
DEFAULT_PLOT = REPO / "docs" / "staleness_sweep.png"

Results = dict[str, dict[int, dict[int, dict[str, Any]]]]
"""stabiliser -> staleness -> seed -> {"records": [...], "process_s": ..., "result": {...}} (vs_trl.load_result)."""


# ------------------------------------------------------------------------------ derived jobs (pure)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `overrides` merged in: nested mappings merge key by key, a None value
    deletes the key (per-sample staleness must not carry maxHeadOffpolicyness), anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def staleness_overrides(level: int, policy: str = "global-budget") -> dict[str, Any]:
    """Spec overrides that make every batch `level` versions stale: the bound at `level` and the
    engines `level` versions behind (trainer.weightSyncLag, which must stay within the bound)."""
    if level < 0:
        raise ValueError(f"staleness must be >= 0, got {level}")
    bound = ({"asyncRatio": level, "maxHeadOffpolicyness": None} if policy == "per-sample"
             else {"maxHeadOffpolicyness": level})
    return {"staleness": bound, "trainer": {"weightSyncLag": level}}


def derive(document: dict[str, Any], stabiliser: str, level: int, device: str | None = None) -> dict[str, Any]:
    """The job document for one cell: the stabiliser's overrides, then the forced staleness under the
    resulting staleness policy, then trainer.device when given."""
    doc = merge(document, {"spec": STABILISERS[stabiliser]})
    policy = doc.get("spec", {}).get("staleness", {}).get("policy", "global-budget")
    doc = merge(doc, {"spec": staleness_overrides(level, policy)})
    if device is not None:
        doc = merge(doc, {"spec": {"trainer": {"device": device}}})
    return doc


def validation_error(document: dict[str, Any], source: str) -> str | None:
    """The loader's error for a derived job (None: valid), so a bad combination is named by the spec."""
    from asyncrl.api.loader import JobFileError, parse_job

    try:
        parse_job(document, source=source)
    except JobFileError as exc:
        return str(exc)
    return None


def check_stabilisers(document: dict[str, Any], stabilisers: list[str], levels: list[int],
                      device: str | None = None) -> dict[str, str]:
    """Stabiliser -> why it is skipped: the loader's error for the first staleness level it fails at."""
    skipped = {}
    for name in stabilisers:
        for level in levels:
            err = validation_error(derive(document, name, level, device), f"{name} at staleness {level}")
            if err is not None:
                skipped[name] = err
                break
    return skipped


def write_job(document: dict[str, Any], dest: Path) -> Path:
    """Write a derived job and load it back with the loader (what `asyncrl run` will read)."""
    import yaml

    from asyncrl.api.loader import load_job

    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(document, sort_keys=False))
    load_job(dest)
    return dest


# ------------------------------------------------------------------------------ figures (pure)


def rewards(records: list[dict[str, Any]]) -> list[float]:
    return [r["reward_mean"] for r in records]


def mean_staleness(records: list[dict[str, Any]], after_step: int = 0) -> float | None:
    """Mean of the steps' mean token staleness over steps > after_step (None: no such step)."""
    vals = [r["staleness_mean"] for r in records if r["step"] > after_step and r.get("staleness_mean") is not None]
    return statistics.fmean(vals) if vals else None


def heldout_pass_at_1(cell: dict[str, Any]) -> float | None:
    """pass@1 of a cell's final policy on the held-out prompts (None: not evaluated)."""
    value = cell["result"].get("heldout", {}).get("pass_at_1")
    return None if value is None else float(value)


def seed_targets(results: Results, seeds: list[int], window: int = WINDOW) -> dict[int, float | None]:
    """Per seed, the final moving average of the reference's synchronous run (None: not run)."""
    ref = results.get(REFERENCE, {}).get(0, {})
    return {s: final_moving_average(rewards(ref[s]["records"]), window) if s in ref else None for s in seeds}


def cell_figures(by_seed: dict[int, dict[str, Any]], seeds: list[int], level: int,
                 targets: dict[int, float | None], sync_times: dict[int, float | None],
                 window: int = WINDOW) -> dict[str, Any]:
    """The figures of one stabiliser at one staleness level, from its per-seed step records."""
    recs = {s: by_seed[s]["records"] for s in seeds if s in by_seed}
    heldout = [heldout_pass_at_1(by_seed[s]) if s in by_seed else None for s in seeds]

    def per_seed(fn: Any) -> list[Any]:
        return [fn(recs[s]) if s in recs else None for s in seeds]

    ttt = [time_to_target(recs[s], targets[s], window) if s in recs else None for s in seeds]
    ratios = [sync_times[s] / t if t and sync_times[s] is not None else None for s, t in zip(seeds, ttt)]
    both = [(sync_times[s], t) for s, t in zip(seeds, ttt) if t and sync_times[s] is not None]
    reached = [t for t in ttt if t is not None]
    return {
        "seeds_done": sorted(recs),
        "steps": [len(recs[s]) for s in sorted(recs)],
        "heldout_pass_at_1": spread(heldout),
        "reward_last_quarter": spread(per_seed(lambda r: last_quarter(rewards(r)))),
        "reward_final_ma": spread(per_seed(lambda r: final_moving_average(rewards(r), window))),
        "s_per_step": spread(per_seed(s_per_step), 2),
        "time_to_target_s": {"per_seed": [None if t is None else round(t, 1) for t in ttt],
                             "reached": f"{len(reached)}/{len(recs)}",
                             "mean": round(statistics.fmean(reached), 1) if reached else None},
        "sync_over_this": {"per_seed": [None if r is None else round(r, 3) for r in ratios],
                           "ratio_of_means": round(sum(a for a, _ in both) / sum(b for _, b in both), 3)
                           if both else None},
        "staleness_mean": spread(per_seed(mean_staleness), 3),
        "staleness_after_lag": spread(per_seed(lambda r: mean_staleness(r, level)), 3),
    }


RANKED_BY = "heldout_pass_at_1"
"""The figure the recommendation ranks by: the final policy's held-out pass@1. The training reward
of a step is that of samples the policy generated s versions earlier, so in N steps at staleness s
the last quarter's reward shows the policies of updates 1..N-1-s; with 12 steps at staleness 8 those
were made at staleness <= 2, and no stabiliser's handling of staleness 8 could show in it."""


def recommend_level(cells: dict[str, dict[str, Any]], figure: str = RANKED_BY,
                    seeds: list[int] | None = None) -> dict[str, Any]:
    """The best stabiliser at one level, and whether its lead over the reference exceeds the seed
    spread (the larger std of the two; one seed can never separate).

    The best is selected on the seeds every ranked stabiliser has, and its lead is paired: measured on
    the seeds it shares with the reference. Means over unequal seed sets would favour a stabiliser run
    only on a lucky seed over one also run on an unlucky one (the sweep runs its leaders on a second
    seed, so it always has unequal sets). `seeds` names the positions of the per-seed figures."""
    per_seed = {name: c[figure]["per_seed"] for name, c in cells.items()
                if c.get(figure, {}).get("mean") is not None}
    if not per_seed:
        return {"best": None, "pick": None, "verdict": "no finished runs"}
    positions = range(len(next(iter(per_seed.values()))))
    names = seeds if seeds is not None else list(positions)
    shared = [i for i in positions if all(v[i] is not None for v in per_seed.values())]

    def mean_on(name: str, at: list[int]) -> float:
        return statistics.fmean(per_seed[name][i] for i in at) if at else cells[name][figure]["mean"]

    best = max(per_seed, key=lambda name: mean_on(name, shared))
    out: dict[str, Any] = {"ranked_by": figure, "best": best, "selected_on_seeds": [names[i] for i in shared],
                           f"best_{figure}": cells[best][figure]["mean"]}
    if REFERENCE not in per_seed:
        return {**out, "pick": None, "verdict": f"no {REFERENCE} run at this staleness to compare with"}
    pairs = [i for i in positions if per_seed[best][i] is not None and per_seed[REFERENCE][i] is not None]
    top, ref = ([per_seed[n][i] for i in pairs] for n in (best, REFERENCE))
    lead = round(statistics.fmean(top) - statistics.fmean(ref), 4) if pairs else None
    noise = round(max(spread(top)["std"] or 0.0, spread(ref)["std"] or 0.0), 4)
    out.update({f"{REFERENCE}_{figure}": cells[REFERENCE][figure]["mean"], f"lead_over_{REFERENCE}": lead,
                "lead_on_seeds": [names[i] for i in pairs], "seed_spread": noise, "seeds": len(pairs)})
    if best == REFERENCE:
        return {**out, "separable": None, "pick": REFERENCE, "verdict": f"{REFERENCE} has the best mean"}
    if lead is not None and len(pairs) >= 2 and lead > noise:
        return {**out, "separable": True, "pick": best,
                "verdict": f"{best}: lead {lead} over {REFERENCE} exceeds the seed spread {noise}"}
    if lead is None:
        why = f"no seed shared with {REFERENCE}"
    elif lead <= 0:
        why = f"{best} led on seeds {out['selected_on_seeds']}, {REFERENCE} on the {len(pairs)} they share"
    else:
        why = "one seed" if len(pairs) < 2 else f"lead {lead} <= seed spread {noise}"
    return {**out, "separable": False, "pick": REFERENCE, "verdict": f"cannot separate at this scale ({why})"}


def summarise(results: Results, stabilisers: list[str], levels: list[int], seeds: list[int],
              skipped: dict[str, str] | None = None, window: int = WINDOW,
              ranked_by: str = RANKED_BY) -> dict[str, Any]:
    """Named figures per stabiliser x staleness, the recommendation per level, and reward per step."""
    skipped = skipped or {}
    targets = seed_targets(results, seeds, window)
    ref = results.get(REFERENCE, {}).get(0, {})
    sync_times = {s: time_to_target(ref[s]["records"], targets[s], window) if s in ref else None for s in seeds}
    cells: dict[str, Any] = {}
    per_step: dict[str, Any] = {}
    for name in stabilisers:
        if name in skipped:
            cells[name] = {"skipped": skipped[name]}
            continue
        by_level = results.get(name, {})
        cells[name] = {str(lv): cell_figures(by_level.get(lv, {}), seeds, lv, targets, sync_times, window)
                       for lv in levels}
        per_step[name] = {str(lv): {str(s): [round(x, 3) for x in rewards(v["records"])]
                                    for s, v in sorted(by_level.get(lv, {}).items())} for lv in levels}
    ran = {n: c for n, c in cells.items() if "skipped" not in c}
    return {
        "window": window,
        "target_per_seed": {str(s): None if t is None else round(t, 4) for s, t in targets.items()},
        "target_definition": f"final {window}-step moving average of {REFERENCE}'s reward at staleness 0, per seed",
        "cells": cells,
        "recommendation": {str(lv): recommend_level({n: c[str(lv)] for n, c in ran.items()}, ranked_by, seeds)
                           for lv in levels},
        "reward_per_step": per_step,
    }


# ------------------------------------------------------------------------------ running


def cell_name(stabiliser: str, level: int) -> str:
    """The `system` of vs_trl's run_dir/load_result for one cell: <out>/<stabiliser>/s<level>/seed<N>."""
    return f"{stabiliser}/s{level}"


def load_cell(out: Path, stabiliser: str, level: int, seed: int, steps: int, job: Path,
              spec: dict[str, Any], heldout_prompts: int = HELDOUT_PROMPTS) -> dict[str, Any] | None:
    """A finished cell run of this job with this derived spec, at least `steps` steps and its final
    policy evaluated on `heldout_prompts` held-out prompts (0: not asked for), or None."""
    found = load_result(out, cell_name(stabiliser, level), seed, steps, job)
    if found is None or found["result"].get("derived_spec") != spec:
        return None
    if heldout_prompts and found["result"].get("heldout", {}).get("prompts") != heldout_prompts:
        return None
    return found


HEAVY_RUN_PARTS = ("weights", "checkpoints")
"""What `asyncrl run` leaves in a run directory that the sweep's figures never read."""


def prune_run(cell_dir: Path) -> int:
    """Delete a finished cell's weights and checkpoints (a sweep of 30+ runs would fill the disk); bytes freed."""
    freed = 0
    for part in HEAVY_RUN_PARTS:
        target = cell_dir / "run" / part
        if target.is_dir():
            freed += sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
            shutil.rmtree(target)
    return freed


def evaluate_final_policy(cell_dir: Path, prompts: int) -> dict[str, Any]:
    """`asyncrl eval` of the run's final weights under the derived job's spec.evaluation (benchmarks/
    heldout.py's, greedy) on `prompts` held-out prompts: the policy the stabiliser trained, with no lag."""
    weights, _ = final_weights(cell_dir / "run")
    found = evaluate(weights, cell_dir / "job.yaml", ["--prompts", str(prompts), "--threads", str(os.cpu_count() or 1)])
    return {"prompts": found["prompts"], "pass_at_1": found["pass_at_1"], "policy_version": found["policy_version"],
            "response_length": round(found["response_length"], 2), "seconds": round(found["seconds"], 1)}


def run_cell(out: Path, stabiliser: str, level: int, seed: int, steps: int, job: Path,
             document: dict[str, Any], keep_weights: bool = False, heldout_prompts: int = HELDOUT_PROMPTS) -> None:
    """Train one cell afresh (a partial attempt's clock means nothing) and store result.json."""
    from asyncrl.api.loader import load_job

    d = run_dir(out, cell_name(stabiliser, level), seed)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    derived = write_job(document, d / "job.yaml")
    # `asyncrl run --eta` would override the bound: pass the derived job's own (4, unused, for per-sample)
    eta = load_job(derived).spec.staleness.max_head_offpolicyness
    print(f"staleness_sweep: {stabiliser} staleness {level} seed {seed}: {steps} steps ({d})", file=sys.stderr,
          flush=True)
    load_start = os.getloadavg()[0]
    result = run_asyncrl(derived, eta, seed, steps, d)
    result.update({"stabiliser": stabiliser, "staleness": level, "source_job": str(job),
                   "derived_spec": document["spec"],
                   "load_average": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)}})
    if heldout_prompts:
        result["heldout"] = evaluate_final_policy(d, heldout_prompts)
    (d / "result.json").write_text(json.dumps(result, indent=2, default=str))
    if not keep_weights:
        freed = prune_run(d)
        print(f"staleness_sweep: deleted {freed / 1e9:.1f} GB of weights and checkpoints in {d / 'run'}",
              file=sys.stderr, flush=True)


def sweep(document: dict[str, Any], job: Path, out: Path, stabilisers: list[str], levels: list[int],
          seeds: list[int], steps: int, device: str | None, keep_weights: bool = False,
          train: bool = True,
          heldout_prompts: int = HELDOUT_PROMPTS) -> tuple[Results, dict[str, str], list[str]]:
    """Run every missing cell (seed by seed, so each seed's target run comes first) and load them all:
    (results, the cells that failed with why, the cells not run).

    With `train` False nothing is run: a cell without a result is only listed as not run (a summary
    of a sweep done over several sittings)."""
    failed: dict[str, str] = {}
    missing: list[str] = []
    results: Results = {}
    for seed in seeds:
        for level in levels:
            for name in stabilisers:
                doc = derive(document, name, level, device)
                found = load_cell(out, name, level, seed, steps, job, doc["spec"], heldout_prompts)
                if found is None and not train:
                    missing.append(f"{name}/s{level}/seed{seed}")
                elif found is None:
                    try:
                        run_cell(out, name, level, seed, steps, job, doc, keep_weights, heldout_prompts)
                    except SystemExit as exc:  # async_vs_sync.run's failure: keep going, rerun next time
                        failed[f"{name}/s{level}/seed{seed}"] = str(exc)[-2000:]
                        print(f"staleness_sweep: {name} staleness {level} seed {seed} failed:\n{exc}",
                              file=sys.stderr, flush=True)
                        continue
                    found = load_cell(out, name, level, seed, steps, job, doc["spec"], heldout_prompts)
                else:
                    print(f"staleness_sweep: {name} staleness {level} seed {seed}: already in {out}",
                          file=sys.stderr)
                if found is not None:
                    results.setdefault(name, {}).setdefault(level, {})[seed] = found
    return results, failed, missing


# ------------------------------------------------------------------------------ plot


def sweep_series(results: Results, levels: list[int], window: int = WINDOW) -> dict[str, Any]:
    """Per staleness level, vs_trl's plot series of every stabiliser (mean over seeds per step)."""
    return {str(lv): plot_series({name: by_level[lv] for name, by_level in results.items() if lv in by_level},
                                 window) for lv in levels}


def sweep_heldout(results: Results, levels: list[int]) -> dict[str, dict[str, list[float]]]:
    """Per staleness level, each stabiliser's held-out pass@1 per evaluated seed (the plot's bars)."""
    out: dict[str, dict[str, list[float]]] = {}
    for lv in levels:
        by_name = {name: [v for c in by_level[lv].values() if (v := heldout_pass_at_1(c)) is not None]
                   for name, by_level in results.items() if lv in by_level}
        out[str(lv)] = {name: vals for name, vals in by_name.items() if vals}
    return out


def render_plot(series: dict[str, Any], path: Path, title: str = "", window: int = WINDOW,
                heldout: dict[str, dict[str, list[float]]] | None = None) -> None:
    """One column per staleness level: moving-average reward vs step, a line per stabiliser; below
    it (when any run was evaluated) the final policies' held-out pass@1, a bar per stabiliser (the
    mean) with a dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    bars = heldout is not None and any(heldout.values())
    fig, axes = plt.subplots(2 if bars else 1, len(series), figsize=(5.5 * len(series), 9.0 if bars else 4.5),
                             sharey="row", constrained_layout=True, squeeze=False)
    names = list(dict.fromkeys(name for by_name in (heldout or {}).values() for name in by_name))
    for ax, level in zip(axes[1] if bars else [], series):  # the same rows in every column
        by_name = (heldout or {}).get(level, {})
        for i, name in enumerate(names):
            if vals := by_name.get(name):
                ax.barh(i, sum(vals) / len(vals), color="tab:blue", alpha=0.5)
                ax.plot(vals, [i] * len(vals), "k.", markersize=6)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.6, len(names) - 0.4)
        ax.set_xlim(0, 1)
        ax.set_xlabel("final policy: held-out pass@1 (bar: mean; dots: seeds)")
        ax.grid(axis="x", alpha=0.3)
    for ax, (level, by_name) in zip(axes[0], series.items()):
        for name, s in by_name.items():
            ax.plot(s["step"], s["reward_ma"], marker="o", markersize=3,
                    label=f"{name} ({s['seeds']} seed{'s' if s['seeds'] != 1 else ''})")
        ax.set_title(f"staleness {level}" + (" (synchronous)" if level == "0" else ""))
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if by_name:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"reward, {window}-step moving average (mean over seeds)")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_python(given: Path | None, explicit: bool) -> Path | None:
    """The interpreter that draws: --plot-python, .venv-trl's, or (only when --plot was asked for)
    .venv-trl made by ensure_trl_venv (it installs torch and trl: too slow to do unasked)."""
    if given is not None:
        return given
    trl_python = TRL_VENV / "bin" / "python"
    if trl_python.exists():
        return trl_python
    return ensure_trl_venv() if explicit else None


def write_plot(series: dict[str, Any], png: Path, out: Path, title: str, python: Path | None,
               window: int = WINDOW, heldout: dict[str, dict[str, list[float]]] | None = None) -> str:
    """Draw the plot in `python` (which has matplotlib); returns what happened, for stderr and JSON."""
    data = out / "plot_series.json"
    data.write_text(json.dumps({"series": series, "title": title, "window": window, "heldout": heldout}))
    if python is None or not python.exists():
        return f"not drawn: no interpreter with matplotlib (pass --plot-python or --plot); series in {data}"
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--render-plot", str(data), str(png)],
                          cwd=REPO, stdout=sys.stderr)
    if proc.returncode != 0 or not png.exists():
        return f"not drawn: {python} failed ({proc.returncode}); series in {data}"
    return f"written to {png}"


# ------------------------------------------------------------------------------ command line


def parse_list(text: str, kind: type = str) -> list[Any]:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="staleness_sweep.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    cpu, full = CPU_DEFAULTS, FULL_DEFAULTS
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "local.yaml",
                        help="base job (default examples/local.yaml)")
    parser.add_argument("--stabilisers", help=f"comma list of {', '.join(STABILISERS)}, or all "
                        f"(default {cpu['stabilisers']}; --full: all)")
    parser.add_argument("--staleness", help=f"comma list of forced staleness levels (default {cpu['staleness']})")
    parser.add_argument("--seeds", help=f"comma list of seeds (default {cpu['seeds']}; --full: {full['seeds']})")
    parser.add_argument("--steps", type=int, help=f"steps per run (default {cpu['steps']}; --full: {full['steps']})")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"],
                        help="set trainer.device (default: the job's own; --full: auto)")
    parser.add_argument("--full", action="store_true",
                        help="the GPU machine's sweep: every stabiliser, 3 seeds, 40 steps, trainer.device auto")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "staleness_sweep",
                        help="results, resumable (default runs/staleness_sweep)")
    parser.add_argument("--plot", default=None,
                        help="PNG path (default docs/staleness_sweep.png, drawn only where .venv-trl exists; "
                             "given explicitly, .venv-trl is set up when missing; '' = no plot)")
    parser.add_argument("--plot-python", type=Path, default=None, help="interpreter with matplotlib for the plot")
    parser.add_argument("--no-train", action="store_true",
                        help="train nothing: summarise (and plot) the cells of the grid already in --out; "
                             "the cells not run yet are listed under missing")
    parser.add_argument("--heldout-prompts", type=int, default=HELDOUT_PROMPTS,
                        help=f"held-out prompts the final policy of each run answers, greedy (default "
                             f"{HELDOUT_PROMPTS}; 0 = do not evaluate, and rank by the training reward)")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each finished run's weights/ and checkpoints/ (default: deleted once measured)")
    parser.add_argument("--window", type=int, default=WINDOW, help=f"moving-average window (default {WINDOW})")
    parser.add_argument("--render-plot", nargs=2, metavar=("SERIES_JSON", "PNG"), help=argparse.SUPPRESS)
    return parser


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep's grid: explicit flags over --full's or the CPU defaults."""
    base = FULL_DEFAULTS if args.full else CPU_DEFAULTS
    pick = {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in base}
    names = ",".join(STABILISERS) if pick["stabilisers"] == "all" else pick["stabilisers"]
    return {"stabilisers": parse_list(names), "levels": parse_list(pick["staleness"], int),
            "seeds": parse_list(pick["seeds"], int), "steps": int(pick["steps"]), "device": pick["device"]}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render_plot:  # (run by an interpreter that has matplotlib)
        data = json.loads(Path(args.render_plot[0]).read_text())
        render_plot(data["series"], Path(args.render_plot[1]), data.get("title", ""), data.get("window", WINDOW),
                    data.get("heldout"))
        return 0
    grid = settings(args)
    unknown = [s for s in grid["stabilisers"] if s not in STABILISERS]
    if unknown:
        parser.error(f"unknown stabiliser(s) {', '.join(unknown)}; choose from {', '.join(STABILISERS)}")
    if any(lv < 0 for lv in grid["levels"]) or not grid["levels"] or not grid["seeds"] or grid["steps"] < 1:
        parser.error("--staleness needs levels >= 0, --seeds at least one seed, --steps >= 1")

    import yaml
    from machine import load_average, machine_figures

    load_start = load_average()
    job, out = args.job.resolve(), args.out.resolve()
    document = yaml.safe_load(job.read_text())
    skipped = check_stabilisers(document, grid["stabilisers"], grid["levels"], grid["device"])
    for name, why in skipped.items():
        print(f"staleness_sweep: skipping {name}: its derived job fails validation:\n{why}", file=sys.stderr)
    runnable = [s for s in grid["stabilisers"] if s not in skipped]
    out.mkdir(parents=True, exist_ok=True)
    results, failed, missing = sweep(document, job, out, runnable, grid["levels"], grid["seeds"], grid["steps"],
                                     grid["device"], args.keep_weights, train=not args.no_train,
                                     heldout_prompts=args.heldout_prompts)
    figures = {"job": str(args.job), "steps": grid["steps"], "seeds": grid["seeds"], "staleness": grid["levels"],
               "stabilisers": grid["stabilisers"], "device": grid["device"] or "the job's", "out": str(out),
               "overrides": {n: STABILISERS[n] for n in grid["stabilisers"]},
               **summarise(results, grid["stabilisers"], grid["levels"], grid["seeds"], skipped, args.window,
                          RANKED_BY if args.heldout_prompts else "reward_last_quarter"),
               "failed": failed, "missing": missing, "machine": machine_figures(load_start)}
    plot = str(DEFAULT_PLOT) if args.plot is None else args.plot
    if plot:
        title = f"{args.job.name}: {grid['steps']} steps, seeds {','.join(map(str, grid['seeds']))}"
        series = sweep_series(results, grid["levels"], args.window)
        figures["plot"] = write_plot(series, Path(plot).resolve(), out, title,
                                     plot_python(args.plot_python, args.plot is not None), args.window,
                                     sweep_heldout(results, grid["levels"]))
        print(f"staleness_sweep: plot {figures['plot']}", file=sys.stderr)
    (out / "summary.json").write_text(json.dumps(figures, indent=2))
    print(compact_json(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
