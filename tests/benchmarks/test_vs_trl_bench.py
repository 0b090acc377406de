"""The pure parts of benchmarks/vs_trl.py and benchmarks/trl_peer.py (no training, no trl import)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.api.loader import load_job, load_jobs_text
from tests.support.bench_support import BENCHMARKS, load_benchmark
from tests.support.paths import REPO

vs = load_benchmark("vs_trl")
peer = load_benchmark("trl_peer")


def recs(rewards: list[float], dt: float = 10.0, start: float = 0.0) -> list[dict]:
    return [{"step": i + 1, "wall_s": start + dt * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]


# ------------------------------------------------------------------------------ moving average, target


def test_moving_average_is_trailing_with_partial_start():
    assert vs.moving_average([1, 2, 3, 4, 5, 6], 3) == pytest.approx([1, 1.5, 2, 3, 4, 5])
    assert vs.moving_average([], 5) == []
    assert vs.moving_average([0.5], 5) == [0.5]
    with pytest.raises(ValueError):
        vs.moving_average([1.0], 0)


def test_moving_average_window_5_on_longer_series():
    values = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    ma = vs.moving_average(values)
    assert ma[4] == pytest.approx(0.2) and ma[6] == pytest.approx(0.6)


def test_final_moving_average_uses_all_steps_of_a_short_run():
    assert vs.final_moving_average([0.1, 0.3]) == pytest.approx(0.2)
    assert vs.final_moving_average([0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.5]) == pytest.approx(0.5)
    assert vs.final_moving_average([]) is None


def test_time_to_target_first_full_window_reaching_it():
    r = recs([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # moving averages from step 5 on: 0, .2, .4, .6, .8, 1.0
    assert vs.time_to_target(r, 0.4) == 70.0
    assert vs.time_to_target(r, 1.0) == 100.0
    assert vs.time_to_target(r, 1.01) is None
    assert vs.time_to_target(r, None) is None
    assert vs.time_to_target([], 0.1) is None


def test_time_to_target_ignores_partial_windows():
    # step 1 alone is 1.0, but the first full window (steps 1-5) averages 0.2
    r = recs([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert vs.time_to_target(r, 0.5) is None
    assert vs.time_to_target(r, 0.2) == 50.0


def test_reference_reaches_its_own_final_average():
    r = recs([0.1, 0.2, 0.5, 0.3, 0.4, 0.2, 0.6, 0.1])
    target = vs.final_moving_average([x["reward_mean"] for x in r])
    assert vs.time_to_target(r, target) is not None


def test_last_quarter_and_spread():
    assert vs.last_quarter([0, 0, 0, 0, 0, 0, 1, 1]) == 1.0
    assert vs.last_quarter([0.2, 0.4]) == 0.4  # at least one value
    assert vs.last_quarter([]) is None
    s = vs.spread([0.1, 0.3, None])
    assert s["mean"] == pytest.approx(0.2) and s["min"] == 0.1 and s["max"] == 0.3
    assert s["std"] == pytest.approx(0.1414, abs=1e-4) and s["per_seed"] == [0.1, 0.3, None]
    assert vs.spread([0.5])["std"] == 0.0
    assert vs.spread([None])["mean"] is None


def test_seconds_per_step():
    r = recs([0, 0, 0, 0], dt=10.0, start=5.0)  # walls 15, 25, 35, 45
    assert vs.s_per_step(r) == pytest.approx(45 / 4)
    assert vs.s_per_step_steady(r) == pytest.approx(10.0)
    assert vs.s_per_step_steady(r[:1]) is None and vs.s_per_step([]) is None


# ------------------------------------------------------------------------------ asyncrl metrics


def test_records_from_metrics_clock_starts_at_trainer_or_rollout():
    metrics = [{"step": 1, "time": 1000.0, "step_seconds": 30.0, "reward_mean": 0.1, "response_length": 20.0},
               {"step": 2, "time": 1020.0, "step_seconds": 20.0, "reward_mean": 0.2, "response_length": 18.0}]
    r = vs.records_from_metrics(metrics)
    assert [x["wall_s"] for x in r] == [30.0, 50.0]
    assert r[0]["completion_length"] == 20.0 and r[1]["reward_mean"] == 0.2
    early = vs.records_from_metrics(metrics, rollout_start=960.0)  # rollout started before the trainer
    assert [x["wall_s"] for x in early] == [40.0, 60.0]
    late = vs.records_from_metrics(metrics, rollout_start=990.0)
    assert [x["wall_s"] for x in late] == [30.0, 50.0]
    assert vs.records_from_metrics([]) == []


# ------------------------------------------------------------------------------ summary


def _results() -> dict:
    return {
        "trl": {0: {"records": recs([0.0] * 5 + [0.5] * 5, dt=20.0), "process_s": 250.0},
                1: {"records": recs([0.0] * 5 + [0.4] * 5, dt=20.0), "process_s": 240.0}},
        "asyncrl-eta2-loglinear": {0: {"records": recs([0.0] * 5 + [0.5] * 5, dt=10.0), "process_s": 130.0},
                                   1: {"records": recs([0.0] * 10, dt=10.0), "process_s": 120.0}},
    }


def test_summary_figures_from_synthetic_records():
    out = vs.summarize(_results(), [0, 1])
    assert out["target_per_seed"] == {"0": 0.5, "1": 0.4}
    trl, asy = out["systems"]["trl"], out["systems"]["asyncrl-eta2-loglinear"]
    assert trl["time_to_target_s"]["per_seed"] == [200.0, 200.0]
    assert trl["trl_over_system"]["per_seed"] == [1.0, 1.0]
    assert asy["time_to_target_s"]["per_seed"] == [100.0, None]
    assert asy["time_to_target_s"]["reached"] == "1/2" and asy["time_to_target_s"]["mean"] == 100.0
    assert asy["trl_over_system"] == {"per_seed": [2.0, None], "ratio_of_means": 2.0}
    assert asy["reward_last_quarter"]["per_seed"] == [0.5, 0.0]
    assert asy["reward_last_quarter"]["mean"] == 0.25 and asy["reward_last_quarter"]["max"] == 0.5
    assert asy["s_per_step"]["mean"] == 10.0 and trl["s_per_step_steady"]["mean"] == 20.0
    assert trl["process_s"]["mean"] == 245.0
    assert out["reward_per_step"]["trl"]["1"][-1] == 0.4 and len(out["reward_per_step"]["trl"]["0"]) == 10
    json.dumps(out)  # serialisable as printed


def test_summary_without_the_reference_has_null_targets():
    res = {"asyncrl-eta0": {0: {"records": recs([0.1, 0.2]), "process_s": None}}}
    out = vs.summarize(res, [0, 1])
    sys0 = out["systems"]["asyncrl-eta0"]
    assert out["target_per_seed"] == {"0": None, "1": None}
    assert sys0["time_to_target_s"]["per_seed"] == [None, None] and sys0["seeds_done"] == [0]
    assert sys0["trl_over_system"]["ratio_of_means"] is None


def test_plot_series_means_over_seeds_up_to_the_shortest():
    series = vs.plot_series(_results(), window=5)
    trl = series["trl"]
    assert trl["seeds"] == 2 and trl["step"] == list(range(1, 11))
    assert trl["wall_s"][0] == 20.0 and trl["reward_ma"][-1] == pytest.approx(0.45)
    short = {"a": {0: {"records": recs([1.0, 1.0, 1.0])}, 1: {"records": recs([0.0, 0.0])}}}
    assert vs.plot_series(short)["a"]["reward_ma"] == [0.5, 0.5]


def test_load_result_resumes_only_complete_runs(tmp_path):
    d = vs.run_dir(tmp_path, "trl", 0)
    d.mkdir(parents=True)
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs([0.1, 0.2, 0.3])))
    assert vs.load_result(tmp_path, "trl", 0, 3) is None  # no result.json: a partial run
    (d / "result.json").write_text(json.dumps({"process_s": 12.5}))
    got = vs.load_result(tmp_path, "trl", 0, 2)
    assert got["process_s"] == 12.5 and [r["step"] for r in got["records"]] == [1, 2]
    assert vs.load_result(tmp_path, "trl", 0, 4) is None  # shorter than asked: run again
    assert vs.load_result(tmp_path, "trl", 1, 1) is None
    (d / "result.json").write_text(json.dumps({"process_s": 1.0, "source_job": "/a.yaml"}))
    assert vs.load_result(tmp_path, "trl", 0, 2, Path("/a.yaml")) is not None
    assert vs.load_result(tmp_path, "trl", 0, 2, Path("/b.yaml")) is None  # another job: run again


def test_derived_job_sets_the_proximal(tmp_path):
    job = REPO / "examples" / "local.yaml"
    assert vs.derived_job(job, None, tmp_path / "a.yaml") == job
    assert vs.derived_job(job, "loglinear", tmp_path / "b.yaml") == job  # local.yaml's own
    path = vs.derived_job(job, "recompute", tmp_path / "c.yaml")
    assert path == tmp_path / "c.yaml" and load_job(path).spec.algorithm.proximal == "recompute"


def test_every_asyncrl_system_is_defined():
    assert set(vs.SYSTEMS) == {"trl", "asyncrl-eta0", "asyncrl-eta1-loglinear", "asyncrl-eta2-loglinear",
                               "asyncrl-eta2-recompute"}
    assert vs.SYSTEMS["asyncrl-eta1-loglinear"]["eta"] == 1
    assert vs.SYSTEMS["asyncrl-eta0"]["eta"] == 0 and vs.SYSTEMS["asyncrl-eta2-recompute"]["proximal"] == "recompute"


# ------------------------------------------------------------------------------ spec -> TRL settings


def local_spec(**algorithm):
    job = load_job(REPO / "examples" / "local.yaml")
    spec = job.spec.model_copy(deep=True)
    for key, value in algorithm.items():
        setattr(spec.algorithm, key, value)
    return spec


def test_benchmark_modules_import_neither_trl_nor_torch():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import trl_peer, vs_trl; "
            "print(sorted(m for m in ('trl', 'torch', 'transformers', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_trl_settings_of_the_local_job():
    spec = peer.with_overrides(local_spec(), seed=1, steps=3)
    s = peer.trl_settings(spec, "/tmp/x")
    a = spec.algorithm
    assert s["seed"] == 1 and s["max_steps"] == 3 and spec.dataset.seed == 1
    assert s["per_device_train_batch_size"] == a.batch_size * a.group_size == 32
    assert s["gradient_accumulation_steps"] == 1 and s["num_generations"] == 8 and s["num_iterations"] == 1
    assert s["shuffle_dataset"] is False
    assert s["max_completion_length"] == 32 and s["temperature"] == 1.0
    assert s["top_k"] == 0 and s["top_p"] == 1.0 and s["min_p"] is None and s["repetition_penalty"] == 1.0
    assert s["beta"] == 0.0 and s["loss_type"] == "dapo" and s["scale_rewards"] == "group"
    assert s["learning_rate"] == 5e-6 and s["lr_scheduler_type"] == "constant" and s["warmup_steps"] == 0
    assert (s["adam_beta1"], s["adam_beta2"], s["adam_epsilon"], s["weight_decay"], s["max_grad_norm"]) == \
        (0.9, 0.999, 1e-8, 0.0, 1.0)
    assert s["bf16"] is False and s["fp16"] is False and s["use_cpu"] is True
    assert s["activation_checkpointing"] is False and s["use_vllm"] is False
    assert s["output_dir"] == "/tmp/x"


def test_trl_settings_follow_the_spec():
    s = peer.trl_settings(local_spec(advantage_estimator="dr_grpo", aggregation="seq-mean-token-mean",
                                     clip_eps_high=0.28), "o")
    assert s["scale_rewards"] == "none" and s["loss_type"] == "grpo" and s["epsilon_high"] == 0.28


@pytest.mark.parametrize("change, words", [
    ({"advantage_estimator": "rloo"}, "advantageEstimator"),
    ({"batch_normalize_advantages": True}, "batchNormalizeAdvantages"),
    ({"aggregation": "seq-mean-token-sum-norm"}, "aggregation"),
    ({"minibatches": 2}, "minibatches"),
])
def test_settings_trl_cannot_reproduce_are_refused(change, words):
    spec = local_spec(**change)
    assert any(words in p for p in peer.unsupported_settings(spec))
    with pytest.raises(peer.UnsupportedSettingError, match=words):
        peer.trl_settings(spec, "o")


def test_inert_settings_name_the_off_policy_corrections():
    inert = peer.inert_settings(local_spec())
    assert "algorithm.proximal" in inert and "staleness.maxHeadOffpolicyness" in inert
    assert "algorithm.behaviourCap.limit" in inert


def test_prompt_positions_are_asyncrls_order():
    assert list(peer.prompt_positions(3, 4)) == list(range(12))


def test_prompt_text_without_a_chat_template():
    class Plain:
        chat_template = None

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert peer.prompt_text(Plain(), msgs) == "S\nQ\n"


def test_with_overrides_leaves_the_original_alone():
    (job,) = load_jobs_text((REPO / "examples" / "local.yaml").read_text())
    spec = peer.with_overrides(job.spec, seed=7, steps=2)
    assert (spec.seed, spec.dataset.seed, spec.trainer.max_steps) == (7, 7, 2)
    assert (job.spec.seed, job.spec.trainer.max_steps) == (0, 28)


def test_reward_wraps_asyncrls_and_records_the_prompt_order():
    batches: list[list[str]] = []
    reward = peer.make_reward("exact-number", batches)
    got = reward(prompts=["p"] * 4, completions=["The answer is 68.", "70", "", "68"], answer=["68"] * 4,
                 prompt_id=["a", "a", "b", "b"], trainer_state=None)
    assert got == [1.0, 0.0, 0.0, 1.0] and batches == [["a", "b"]]
    assert reward.__name__ == "exact_number"


def test_matched_versions_are_the_late_versions_every_system_reaches():
    assert vs.matched_versions(28) == (19, 25)  # 7 versions; an eta-2 run's last step trains version 25
    assert vs.matched_versions(4) == (1, 1)
    assert vs.matched_versions(2) == (0, 0)


def test_reward_at_versions_compares_the_generating_policy_not_the_step():
    # The same learning curve, one run synchronous and one lagging by exactly 2 versions:
    # per step the lagging run looks worse; per generating version the two are the same.
    curve = [i / 10 for i in range(10)]  # reward of version v's samples is v / 10
    sync = [{"step": i + 1, "wall_s": 10.0 * (i + 1), "reward_mean": curve[i], "staleness_mean": 0.0}
            for i in range(10)]
    lagging = [{"step": i + 1, "wall_s": 10.0 * (i + 1), "reward_mean": curve[max(i - 2, 0)],
                "staleness_mean": float(min(i, 2))} for i in range(10)]
    lo, hi = vs.matched_versions(10)
    assert (lo, hi) == (6, 7)
    assert vs.reward_at_versions(sync, lo, hi) == pytest.approx(0.65)
    assert vs.reward_at_versions(lagging, lo, hi) == pytest.approx(0.65)
    assert vs.last_quarter([r["reward_mean"] for r in lagging]) < vs.last_quarter(curve)
    assert vs.reward_at_versions(sync, 20, 30) is None  # no step trained those versions
    out = vs.summarize({"trl": {0: {"records": sync}}, "asyncrl-eta2-loglinear": {0: {"records": lagging}}}, [0])
    assert out["matched_versions"] == [6, 7]
    assert out["systems"]["asyncrl-eta2-loglinear"]["reward_matched_versions"]["mean"] == pytest.approx(0.65)


# ----------------------------------------------------------------------------- benchmarks/heldout.py

heldout = load_benchmark("heldout")


def test_heldout_reads_a_finished_runs_final_weights_and_seed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    job = load_job(REPO / "examples" / "local.yaml").model_copy(deep=True)
    job.spec.seed = 5
    (run / "job.yaml").write_text(json.dumps(job.model_dump(by_alias=True, exclude_none=True, mode="json")))
    (run / "run.json").write_text(json.dumps({"outcome": "succeeded", "final_weights": "/w/v28"}))
    assert heldout.final_weights(run) == ("/w/v28", 5)
    (run / "run.json").write_text(json.dumps({"outcome": "failed", "final_weights": None}))
    with pytest.raises(SystemExit, match="no final_weights"):
        heldout.final_weights(run)


def test_heldout_spread_is_mean_min_max():
    assert heldout.spread([0.5, 0.7, 0.6]) == {"mean": 0.6, "min": 0.5, "max": 0.7}
