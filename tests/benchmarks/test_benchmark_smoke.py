"""Every benchmark in benchmarks/ runs here at its smallest size, so none can rot unnoticed.

Each script runs as its own process (`sys.executable`, the repo as working directory and on
PYTHONPATH) through its real code path at tiny sizes: the one-layer model of SmolLM2's architecture
(tests/support/trainer_support.py `tiny_model`, written as an HF directory) wherever a benchmark
takes a model or a job, one step, one repetition, a few prompts and tokens. The test parses what it
printed as one JSON object and checks the figures it names (the keys docs/benchmarks.md and the
script's own docstring give). The figures themselves mean nothing at these sizes: nothing here
compares them. A new script in benchmarks/ must get a row in SMOKES or be declared in HELPERS
(`test_every_benchmark_has_a_smoke_run_or_is_a_helper`).

The rows that need Hugging Face TRL run only where .venv-trl exists (bash scripts/setup-trl.sh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_support import BENCHMARKS
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO

TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
NO_TRL = f"needs Hugging Face TRL in {TRL_PYTHON.parent.parent} (bash scripts/setup-trl.sh)"

# benchmarks/machine.py's figures, which most benchmarks append
MACHINE = {"torch_threads", "cpu_count", "load_avg_1m_start", "load_avg_1m_end", "torch", "python"}

# Modules of benchmarks/ that are no benchmark of their own, and a benchmark with a smoke run that
# uses each (its source names it).
HELPERS = {
    "machine": "trainer_scale",  # the machine figures every benchmark prints (imported)
    "episode_workload": "episodes",  # the slow-tool episode plug-in of episodes.py's job
}


@dataclass(frozen=True)
class Smoke:
    """One smoke run: benchmarks/<script>.py with `args` ({model}, {job}, {agent_job}, {run},
    {out} and {trl_python} filled in); the JSON it prints must have `keys`, and the object at each
    dotted path of `nested` (a list index is a number) the keys given there."""

    script: str
    args: tuple[str, ...]
    keys: frozenset[str]
    nested: dict[str, frozenset[str]] = field(default_factory=dict)
    trl: bool = False  # runs in .venv-trl
    timeout_s: int = 420

    @property
    def id(self) -> str:
        return self.script + ("-trl" if self.trl and self.script == "vs_trl" else "")


def keys(*groups: Any) -> frozenset[str]:
    out: set[str] = set()
    for g in groups:
        out |= {g} if isinstance(g, str) else set(g)
    return frozenset(out)


def prefixed(prefixes: tuple[str, ...], names: tuple[str, ...]) -> set[str]:
    return {f"{p}_{n}" for p in prefixes for n in names}


VS_TRL_KEYS = keys("job", "steps", "seeds", "out", "plot", "window", "target_per_seed", "target_definition",
                   "matched_versions", "matched_versions_definition", "systems", "reward_per_step")
VS_TRL_SYSTEM = keys("seeds_done", "steps", "reward_last_quarter", "reward_matched_versions", "reward_final_ma",
                     "s_per_step", "s_per_step_steady", "train_wall_s", "process_s", "load_average_start",
                     "time_to_target_s", "trl_over_system")
SAMPLING_SIDE = keys("samples", "reward_mean", "reward_se", "length_mean", "stopped_share", "truncated_share")

SMOKES = (
    Smoke("proximal_cost", ("--model", "{model}", "--reps", "1", "--seqs", "4", "--tokens", "8", "--prompt-tokens",
                            "8", "--minibatches", "2"),
          keys("recompute_step_s", "loglinear_step_s", "recompute_prox_s", "loglinear_prox_s", "step_speedup",
               "prox_speedup", "loglinear_prox_fraction_of_step", "recompute_prox_fraction_of_step", "train_only_s",
               "ideal_step_speedup", "reps", "recompute_step_s_all", "loglinear_step_s_all", "seqs", "prompt_tokens",
               "response_tokens", "minibatches", "model", "params", "device", "dtype", MACHINE)),
    # two gloo ranks: FSDP2 shards for real (one rank would not)
    Smoke("trainer_scale", ("--model", "{model}", "--world", "2", "--steps", "2", "--groups", "2", "--group-size",
                            "2", "--tokens", "8", "--prompt-tokens", "8"),
          keys("fsdp_peak_over_ddp", "fsdp_state_over_ddp", "fsdp_step_over_ddp", "loss_rel_diff", "fsdp_peak_gib",
               "ddp_peak_gib", "fsdp_state_gib", "ddp_state_gib", "fsdp_step_s", "ddp_step_s", "fsdp_loss",
               "ddp_loss", "peak_measure", "world", "steps", "tokens_per_step", "model", "device", "dtype",
               "gradient_checkpointing", "threads_per_rank", MACHINE)),
    Smoke("trainer_step", ("--model", "{model}", "--reps", "1", "--groups", "1", "--group-size", "2",
                           "--prompt-tokens", "8", "--min-response", "2", "--max-response", "8",
                           "--micro-batch-tokens", "64", "--one-row"),
          keys("trainer_over_bare_padding", "trainer_over_bare_packing", "packing_over_padding", "one_row_over_padding",
               "packing_layout", "sequences", "tokens", "response_tokens", "micro_batch_tokens", "reps", "model",
               "attn_implementation", "params", "device", "dtype", MACHINE,
               prefixed(("bare", "padding", "packing", "packing_one_row"), ("tokens_per_s", "step_s_all")),
               prefixed(("padding_fraction",), ("bare", "padding", "packing", "packing_one_row")))),
    Smoke("lora", ("--model", "{model}", "--reps", "1", "--groups", "1", "--group-size", "2", "--prompt-tokens", "8",
                   "--min-response", "2", "--max-response", "8", "--micro-batch-tokens", "256", "--rank", "2"),
          keys("lora_over_full_step_s", "lora_over_full_peak_bytes", "lora_over_full_state_bytes",
               "lora_over_full_sync_bytes", "lora_over_full_sync_s", "rank", "alpha", "model", "device", "dtype",
               "reps", "sequences", MACHINE,
               prefixed(("full", "lora"), ("step_s_all", "step_s", "peak_bytes", "state_bytes", "trainable_params",
                                           "params", "sync_bytes", "sync_write_s", "sync_update_s")))),
    Smoke("weight_sync", ("--model", "{model}", "--reps", "1"),
          keys("model", "dtype", "bytes", "engines", "reps", "bucket_mb", "write_s", "disk_update_s",
               "collective_update_s", "raw_write_s", "raw_read_s", "raw_write_read_s", "collective_over_disk",
               "publish_collective_over_disk", "disk_over_raw", "collective_over_raw", "collective_gbps", MACHINE)),
    Smoke("transport", ("--groups-per-producer", "5", "--repeats", "1", "--samples", "2", "--response-tokens", "16",
                        "--prompt-tokens", "8"),
          keys("groups_per_s", "mb_per_s", "encode_us_per_group", "decode_us_per_group", "ratio_vs_raw",
               "raw_groups_per_s", "raw_mb_per_s", "payload_bytes_per_group", "groups_per_run", "runs_groups_per_s",
               "config")),
    # the hf engine (vLLM would need .venv-vllm); one update lands while the worker's pass runs
    Smoke("rollout", ("--engine", "hf", "--model", "{model}", "--prompts", "1", "--group-size", "2",
                      "--max-new-tokens", "4", "--rounds", "1", "--updates", "1"),
          keys("engine", "model", "prompts", "group_size", "max_new_tokens", "concurrency", "rounds",
               "direct_tokens_per_s", "worker_tokens_per_s", "worker_over_engine", "direct_runs", "worker_runs",
               "updates", "updates_during_pass", "sync_tokens_per_s", "sync_over_worker", "sync_interrupted",
               "sync_dropped", "update_seconds_mean", "sync_versions")),
    Smoke("async_vs_sync", ("--job", "{job}", "--steps", "1", "--out-dir", "{out}"),
          keys("job", "steps", "seed", "async_eta", "batch_size", "sync_groups_per_s", "async_groups_per_s", "speedup",
               "sync_rollout_s_per_step", "sync_train_s_per_step", "async_rollout_wait_s_per_step",
               "async_train_s_per_step", "ceiling", "efficiency", "sync_final_reward", "async_final_reward",
               "max_staleness_seen", "sync_max_staleness", "run_dirs")),
    Smoke("episodes", ("--job", "{agent_job}", "--steps", "1", "--group-size", "2", "--tool-median-s", "0.01",
                       "--out-dir", "{out}"),
          keys("job", "steps", "seed", "async_eta", "tool_median_s", "batch_size", "group_size", "episodes_per_s_ratio",
               "episodes_per_s_all_steps_ratio", "trained_tokens_per_s_ratio", "tool_to_generate_ratio", "run_dirs",
               prefixed(("sync", "async"), ("episodes_per_s", "trained_tokens_per_s", "episodes_per_s_all_steps",
                                            "trainer_idle", "tool_s", "generate_s", "turns_mean", "max_staleness")))),
    # {run}: a finished run's directory whose final weights are the tiny model
    Smoke("heldout", ("--job", "{job}", "--prompts", "2", "{run}"),
          keys("job", "prompts", "samples_per_prompt", "base", "runs", "trained_pass_at_1",
               "trained_over_base_pass_at_1", "trained_minus_base_pass_at_1"),
          {"base": keys("model", "pass_at_1", "reward_mean", "response_length"),
           "runs.0": keys("run", "seed", "weights", "pass_at_1", "reward_mean", "response_length")}),
    Smoke("staleness_sweep", ("--job", "{job}", "--stabilisers", "default", "--staleness", "0", "--seeds", "0",
                              "--steps", "1", "--heldout-prompts", "2", "--out", "{out}", "--plot", ""),
          keys("job", "steps", "seeds", "staleness", "stabilisers", "device", "out", "overrides", "window",
               "target_per_seed", "target_definition", "cells", "recommendation", "reward_per_step", "failed",
               "missing", "machine"),
          {"cells.default.0": keys("seeds_done", "steps", "heldout_pass_at_1", "reward_last_quarter",
                                   "reward_final_ma", "s_per_step", "time_to_target_s", "sync_over_this",
                                   "staleness_mean", "staleness_after_lag"),
           "recommendation.0": keys("ranked_by", "best", "pick", "verdict", "lead_over_default", "seed_spread",
                                    "separable"),
           "machine": frozenset(MACHINE)}),
    # asyncrl's side only (the TRL side: vs_trl-trl below)
    Smoke("vs_trl", ("--job", "{job}", "--systems", "asyncrl-eta0", "--seeds", "0", "--steps", "1", "--out", "{out}",
                     "--plot", ""),
          VS_TRL_KEYS, {"systems.asyncrl-eta0": VS_TRL_SYSTEM}),
    # no kill: the kill schedule's path is tests/local/test_chaos.py's (every kind once); a kill here made
    # the smoke run take 70-160 s (a killed component's restart and catch-up) for the same JSON keys
    Smoke("chaos", ("--seeds", "0", "--kills", "0", "--max-steps", "2", "--run-dir", "{out}"),
          keys("seeds", "max_steps", "kills_per_run", "kills_by_kind", "finished", "runs", "lost", "twice", "foreign",
               "ghosts_dropped", "dropped", "drift_found", "leases_returned", "longest_stall_s", "wall_s",
               "undisturbed_wall_s", "overhead_vs_undisturbed", "undisturbed_longest_stall_s")),
    # the job -> GRPOConfig mapping (imports no trl); its training runs under vs_trl-trl
    Smoke("trl_peer", ("--job", "{job}", "--print-settings"),
          keys("trl_settings", "inert_asyncrl_settings")),
    Smoke("vs_trl", ("--job", "{job}", "--systems", "trl", "--trl-python", "{trl_python}", "--seeds", "0", "--steps",
                     "1", "--out", "{out}", "--plot", ""),
          VS_TRL_KEYS, {"systems.trl": VS_TRL_SYSTEM}, trl=True),
    Smoke("sampling_parity", ("--job", "{job}", "--prompts", "1", "--samples", "2", "--threads", "1"),
          keys("job", "prompts", "samples_per_prompt", "max_new_tokens", "temperature", "asyncrl", "trl", "reward_gap",
               "reward_gap_in_se"),
          {"asyncrl": SAMPLING_SIDE, "trl": SAMPLING_SIDE}, trl=True),
    Smoke("trl_step_parity", ("--job", "{job}", "--batches", "1", "--threads", "1"),
          keys("job", "batches", "grad_cosine_min", "grad_norm_ratio_max_dev", "max_abs_diff_rel_max"),
          {"batches.0": keys("prompts_from", "synthetic_reward", "reward_mean", "loss_asyncrl", "loss_trl",
                             "grad_cosine", "grad_norm_ratio", "max_abs_diff_rel")}, trl=True),
)


# ------------------------------------------------------------------------------ the table itself (unit)


def test_every_benchmark_has_a_smoke_run_or_is_a_helper():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    smoked = {s.script for s in SMOKES}
    assert not smoked & set(HELPERS)
    assert scripts - smoked - set(HELPERS) == set(), "a benchmark without a smoke run: add it to SMOKES"
    assert (smoked | set(HELPERS)) - scripts == set(), "SMOKES or HELPERS names a script that is gone"
    for helper, user in HELPERS.items():  # a helper is exercised by a smoke run of a benchmark that uses it
        assert user in smoked and re.search(rf"\b{helper}\b", (BENCHMARKS / f"{user}.py").read_text()), helper
    assert len({s.id for s in SMOKES}) == len(SMOKES)


# ------------------------------------------------------------------------------ the runs (integration)


@pytest.fixture(scope="module")
def smoke_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny model; examples/local.yaml and local-agent.yaml on it at tiny sizes; a finished run's
    directory whose final weights are the tiny model (for heldout.py)."""
    from tests.support.trainer_support import write_tiny_model

    root = tmp_path_factory.mktemp("bench-smoke")
    model = write_tiny_model(root / "tiny-model")
    tiny = {"model.path": str(model), "algorithm.groupSize": 2, "algorithm.batchSize": 1,
            "algorithm.maxNewTokens": 4, "algorithm.microBatchTokens": 1024, "trainer.maxSteps": 2}
    local = JobBuilder.example("local", **tiny, **{"evaluation.prompts": 2, "evaluation.maxNewTokens": 4})
    local.set(logging={}).write(root / "local.yaml")
    JobBuilder.example("local-agent", **tiny).set(logging={}).write(root / "local-agent.yaml")
    run = root / "run"
    run.mkdir()
    (run / "job.yaml").write_text((root / "local.yaml").read_text())
    (run / "run.json").write_text(json.dumps({"outcome": "succeeded", "final_weights": str(model)}))
    return {"model": str(model), "job": str(root / "local.yaml"), "agent_job": str(root / "local-agent.yaml"),
            "run": str(run), "trl_python": str(TRL_PYTHON)}


def at(value: Any, path: str) -> Any:
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


@pytest.mark.slow
@pytest.mark.parametrize("smoke", SMOKES, ids=[s.id for s in SMOKES])
def test_benchmark_runs_and_prints_its_figures(smoke: Smoke, smoke_files: dict[str, str], tmp_path: Path):
    if smoke.trl and not TRL_PYTHON.exists():
        pytest.skip(NO_TRL)
    python = str(TRL_PYTHON) if smoke.trl and smoke.script != "vs_trl" else sys.executable
    args = [a.format(out=tmp_path / "out", **smoke_files) for a in smoke.args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([python, str(BENCHMARKS / f"{smoke.script}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=smoke.timeout_s)
    assert proc.returncode == 0, (f"{smoke.script} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    try:
        figures = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{smoke.script} did not print one JSON object ({exc}):\n{proc.stdout[-3000:]}") from exc
    assert isinstance(figures, dict)
    # a benchmark that goes on past a failed run lists it with its error: none may fail here
    assert not figures.get("failed"), f"{smoke.script}: runs failed: {json.dumps(figures['failed'])[-5000:]}"
    assert smoke.keys - set(figures) == set(), f"{smoke.script} no longer prints these figures"
    for path, expected in smoke.nested.items():
        assert expected - set(at(figures, path)) == set(), f"{smoke.script}: figures missing under {path}"
