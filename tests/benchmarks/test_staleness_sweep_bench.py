"""The pure parts of benchmarks/staleness_sweep.py: derived jobs, forced staleness, figures (no training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import load_job, parse_job
from tests.support.bench_support import BENCHMARKS, load_benchmark
from tests.support.paths import REPO

LOCAL = REPO / "examples" / "local.yaml"
LEVELS = [0, 2, 8]


sw = load_benchmark("staleness_sweep")


@pytest.fixture
def local() -> dict:
    return yaml.safe_load(LOCAL.read_text())


def recs(rewards: list[float], dt: float = 10.0, staleness: float = 0.0) -> list[dict]:
    return [{"step": i + 1, "wall_s": dt * (i + 1), "reward_mean": r, "staleness_mean": staleness}
            for i, r in enumerate(rewards)]


# ------------------------------------------------------------------------------ derived jobs


def test_merge_is_nested_deletes_on_none_and_leaves_the_base_alone():
    base = {"spec": {"algorithm": {"proximal": "loglinear", "optimizer": {"lr": 1e-6}},
                     "staleness": {"maxHeadOffpolicyness": 2}}}
    merged = sw.merge(base, {"spec": {"algorithm": {"proximal": "recompute", "replay": {}},
                                      "staleness": {"policy": "per-sample", "maxHeadOffpolicyness": None,
                                                    "asyncRatio": 3}}})
    assert merged == {"spec": {"algorithm": {"proximal": "recompute", "optimizer": {"lr": 1e-6}, "replay": {}},
                               "staleness": {"policy": "per-sample", "asyncRatio": 3}}}
    assert base["spec"]["algorithm"] == {"proximal": "loglinear", "optimizer": {"lr": 1e-6}}
    assert base["spec"]["staleness"] == {"maxHeadOffpolicyness": 2}
    # a non-mapping replaces a mapping and the merged value is a copy
    extra = {"x": [1]}
    out = sw.merge({"a": {"b": 1}}, {"a": 5, "c": extra})
    assert out == {"a": 5, "c": {"x": [1]}} and out["c"] is not extra


def test_stabiliser_overrides_use_the_specs_field_names(local):
    algo = load_job(LOCAL).spec.algorithm
    for name, level in (("recompute", 2), ("m2po", 2), ("bapo", 2), ("vcpo", 2), ("sapo", 2)):
        alg = parse_job(sw.derive(local, name, level)).spec.algorithm
        assert (alg.proximal, alg.m2, alg.bapo, alg.vcpo, alg.objective) != (
            algo.proximal, algo.m2, algo.bapo, algo.vcpo, algo.objective), name
    m2 = parse_job(sw.derive(local, "m2po", 2)).spec.algorithm.m2
    assert m2 is not None and m2.threshold == 0.04
    cispo = parse_job(sw.derive(local, "cispo", 2)).spec.algorithm
    assert cispo.objective == "cispo" and cispo.clip_eps == 0.99 and cispo.clip_eps_high == 0.28
    default = parse_job(sw.derive(local, "default", 2)).spec.algorithm
    assert default == algo  # default changes nothing but the staleness fields


def test_every_stabiliser_validates_at_every_level_except_tba_before_the_spec_has_it(local):
    for device in (None, "auto"):  # the CPU sweep and --full
        skipped = sw.check_stabilisers(local, list(sw.STABILISERS), LEVELS, device)
        assert set(skipped) <= {"tba"}, skipped
        for name in set(sw.STABILISERS) - set(skipped):
            for level in LEVELS:
                job = parse_job(sw.derive(local, name, level, device))
                assert job.spec.trainer.weight_sync_lag == level, (name, level)
                assert job.spec.trainer.device == (device or "cpu")
    if "tba" in skipped:  # the loader's own error names what the spec lacks
        assert "spec.algorithm" in skipped["tba"] and ("objective" in skipped["tba"] or "replay" in skipped["tba"])
    else:
        alg = parse_job(sw.derive(local, "tba", 8)).spec.algorithm
        assert alg.objective == "tb" and alg.replay is not None


def test_a_bad_combination_is_skipped_with_the_loaders_error(local, monkeypatch):
    monkeypatch.setitem(sw.STABILISERS, "bad", {"algorithm": {"objective": "sapo", "clipEps": 0.3}})
    skipped = sw.check_stabilisers(local, ["default", "bad"], LEVELS)
    assert list(skipped) == ["bad"]
    assert "bad at staleness 0" in skipped["bad"]
    assert "clipEps 0.3 has no effect with objective 'sapo'" in skipped["bad"]
    summary = sw.summarise({}, ["default", "bad"], LEVELS, [0], skipped)
    assert summary["cells"]["bad"] == {"skipped": skipped["bad"]}
    assert "bad" not in summary["recommendation"]["0"] and "bad" not in summary["reward_per_step"]


def test_forced_staleness_global_budget(local):
    assert sw.staleness_overrides(8) == {"staleness": {"maxHeadOffpolicyness": 8}, "trainer": {"weightSyncLag": 8}}
    for level in LEVELS:
        spec = parse_job(sw.derive(local, "default", level)).spec
        assert spec.staleness.policy == "global-budget"
        assert spec.staleness.max_head_offpolicyness == level and spec.staleness.as_policy().version_bound == level
        assert spec.trainer.weight_sync_lag == level
        assert spec.trainer.max_steps == 28 and spec.algorithm.proximal == "loglinear"  # the rest untouched
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        sw.staleness_overrides(-1)


def test_forced_staleness_roll_alpha_is_per_sample_without_eta(local):
    for level in LEVELS:
        doc = sw.derive(local, "roll-alpha", level)
        assert "maxHeadOffpolicyness" not in doc["spec"]["staleness"]  # per-sample rejects it (local.yaml has 2)
        spec = parse_job(doc).spec
        assert spec.staleness.policy == "per-sample" and spec.staleness.async_ratio == level
        assert spec.staleness.as_policy().version_bound == level and spec.trainer.weight_sync_lag == level


def test_written_job_is_the_derived_one_and_loads(local, tmp_path):
    doc = sw.derive(local, "recompute", 2)
    path = sw.write_job(doc, tmp_path / "cell" / "job.yaml")
    assert yaml.safe_load(path.read_text()) == doc
    job = load_job(path)
    assert job.spec.algorithm.proximal == "recompute" and job.spec.trainer.weight_sync_lag == 2
    assert local["spec"]["algorithm"]["proximal"] == "loglinear"  # the base document is untouched


# ------------------------------------------------------------------------------ figures


def cell(records: list[dict], heldout: float | None) -> dict:
    """A loaded cell as vs_trl.load_result gives it, with its final policy's held-out pass@1."""
    return {"records": records, "result": {} if heldout is None else {"heldout": {"pass_at_1": heldout,
                                                                                   "prompts": 256}}}


def _cell_results() -> dict:
    # default@0 sets the targets: seed 0 ends at 0.5 (reached at 100 s), seed 1 at 0.4 (at 200 s).
    # Held-out pass@1 at level 2: default 0.3, 0.3; m2po 0.6, 0.7 (ahead beyond the spread); vcpo 0.8
    # and not evaluated (one seed: not ahead on evidence). vcpo also has the best training reward on
    # seed 1, which the recommendation must not rank by.
    return {
        "default": {0: {0: cell(recs([0.0] * 5 + [0.5] * 5), 0.5),
                        1: cell(recs([0.0] * 5 + [0.4] * 5, dt=20.0), 0.4)},
                    2: {0: cell(recs([0.0] * 5 + [0.2] * 5, staleness=1.5), 0.3),
                        1: cell(recs([0.0] * 5 + [0.2] * 5, staleness=1.5), 0.3)}},
        "m2po": {2: {0: cell(recs([0.0] * 3 + [0.5] * 7, dt=5.0, staleness=1.5), 0.6),
                     1: cell(recs([0.0] * 3 + [0.6] * 7, dt=5.0, staleness=1.5), 0.7)}},
        "vcpo": {2: {0: cell(recs([0.0] * 10, staleness=1.5), 0.8),
                     1: cell(recs([0.0] * 5 + [0.9] * 5, staleness=1.5), None)}},
    }


def test_summary_targets_times_and_ratios():
    out = sw.summarise(_cell_results(), ["default", "m2po", "vcpo"], [0, 2], [0, 1])
    assert out["target_per_seed"] == {"0": 0.5, "1": 0.4}
    sync = out["cells"]["default"]["0"]
    assert sync["time_to_target_s"]["per_seed"] == [100.0, 200.0]
    assert sync["sync_over_this"] == {"per_seed": [1.0, 1.0], "ratio_of_means": 1.0}
    m2po = out["cells"]["m2po"]["2"]
    # m2po's 5-step moving average reaches 0.5 at step 8 (40 s) on seed 0, 0.4 at step 7 (35 s) on seed 1
    assert m2po["time_to_target_s"] == {"per_seed": [40.0, 35.0], "reached": "2/2", "mean": 37.5}
    assert m2po["sync_over_this"]["per_seed"] == [2.5, round(200 / 35, 3)]
    assert m2po["sync_over_this"]["ratio_of_means"] == 4.0  # (100 + 200) / (40 + 35)
    assert m2po["reward_last_quarter"]["per_seed"] == [0.5, 0.6] and m2po["s_per_step"]["mean"] == 5.0
    assert out["cells"]["default"]["2"]["time_to_target_s"]["reached"] == "0/2"
    vcpo0 = out["cells"]["vcpo"]["0"]
    assert vcpo0["seeds_done"] == [] and vcpo0["reward_last_quarter"]["mean"] is None
    assert vcpo0["heldout_pass_at_1"]["mean"] is None
    assert m2po["heldout_pass_at_1"]["per_seed"] == [0.6, 0.7]
    assert out["cells"]["vcpo"]["2"]["heldout_pass_at_1"] == sw.spread([0.8, None])
    assert out["reward_per_step"]["m2po"]["2"]["1"][-1] == 0.6 and out["reward_per_step"]["m2po"]["0"] == {}


def test_staleness_figures_prove_the_forcing():
    r = recs([0.1] * 10)
    for i, x in enumerate(r):
        x["staleness_mean"] = float(min(i, 8))  # step k trains samples min(k - 1, 8) versions old
    assert sw.mean_staleness(r) == pytest.approx((sum(range(8)) + 8 + 8) / 10)
    assert sw.mean_staleness(r, 8) == 8.0
    assert sw.mean_staleness(r, 10) is None
    figures = sw.cell_figures({0: cell(r, None)}, [0], 8, {0: None}, {0: None})
    assert figures["staleness_after_lag"]["mean"] == 8.0 and figures["staleness_mean"]["mean"] == pytest.approx(4.4)
    assert figures["time_to_target_s"]["per_seed"] == [None]


def test_recommendation_separates_a_lead_beyond_the_seed_spread():
    out = sw.summarise(_cell_results(), ["default", "m2po", "vcpo"], [0, 2], [0, 1])
    rec = out["recommendation"]["2"]
    # held-out: vcpo 0.8 (one seed evaluated) ranks first, cannot be separated on one seed
    assert rec["ranked_by"] == "heldout_pass_at_1" and rec["best"] == "vcpo" and rec["separable"] is False
    without_vcpo = sw.summarise(_cell_results(), ["default", "m2po"], [0, 2], [0, 1])["recommendation"]["2"]
    # m2po 0.65 (std 0.0707) vs default 0.3 (std 0): lead 0.35 > 0.0707
    assert without_vcpo["best"] == "m2po" and without_vcpo["pick"] == "m2po" and without_vcpo["separable"] is True
    assert without_vcpo["lead_over_default"] == pytest.approx(0.35)
    assert without_vcpo["seed_spread"] == pytest.approx(0.0707)
    assert out["recommendation"]["0"]["best"] == "default" and out["recommendation"]["0"]["pick"] == "default"
    by_reward = sw.summarise(_cell_results(), ["default", "m2po", "vcpo"], [2], [0, 1],
                             ranked_by="reward_last_quarter")["recommendation"]["2"]
    assert by_reward["ranked_by"] == "reward_last_quarter" and by_reward["best"] == "m2po"


def test_recommendation_cannot_separate_a_lead_within_the_spread():
    cells = {"default": {"heldout_pass_at_1": sw.spread([0.30, 0.40]), "seeds_done": [0, 1]},
             "vcpo": {"heldout_pass_at_1": sw.spread([0.30, 0.46]), "seeds_done": [0, 1]},
             "m2po": {"heldout_pass_at_1": sw.spread([0.20, 0.30]), "seeds_done": [0, 1]}}
    rec = sw.recommend_level(cells)
    assert rec["best"] == "vcpo" and rec["separable"] is False and rec["pick"] == "default"
    assert rec["verdict"].startswith("cannot separate at this scale")
    assert rec["lead_over_default"] == pytest.approx(0.03) and rec["seed_spread"] == pytest.approx(0.1131)


def test_recommendation_with_one_seed_or_no_default():
    one = {"default": {"heldout_pass_at_1": sw.spread([0.1]), "seeds_done": [0]},
           "bapo": {"heldout_pass_at_1": sw.spread([0.9]), "seeds_done": [0]}}
    rec = sw.recommend_level(one)
    assert rec["best"] == "bapo" and rec["separable"] is False and "one seed" in rec["verdict"]
    alone = sw.recommend_level({"bapo": one["bapo"]})
    assert alone["best"] == "bapo" and alone["pick"] is None and "no default run" in alone["verdict"]
    assert sw.recommend_level({})["best"] is None


def test_recommendation_selects_on_the_shared_seeds_and_pairs_the_lead():
    # As measured at staleness 0: seed 1 failed for every stabiliser run on it. By mean over each one's
    # own seeds, m2po (run on seed 0 only) would lead default (run on both) by 0.26; on the seed all
    # share, gspo leads, and against default on the seeds the two share its lead is 0.035.
    cells = {"default": {"heldout_pass_at_1": sw.spread([0.47, 0.05])},
             "gspo": {"heldout_pass_at_1": sw.spread([0.54, 0.05])},
             "m2po": {"heldout_pass_at_1": sw.spread([0.52, None])}}
    rec = sw.recommend_level(cells, seeds=[0, 1])
    assert rec["best"] == "gspo" and rec["selected_on_seeds"] == [0] and rec["lead_on_seeds"] == [0, 1]
    assert rec["lead_over_default"] == pytest.approx(0.035) and rec["seeds"] == 2
    assert rec["seed_spread"] == pytest.approx(0.3465) and rec["separable"] is False and rec["pick"] == "default"
    assert rec["best_heldout_pass_at_1"] == pytest.approx(0.295)


def test_recommendation_says_when_the_selected_leader_falls_behind_on_the_shared_seeds():
    # As measured at staleness 8: m2po led on seed 0 and fell to 0.129 on seed 1.
    cells = {"default": {"heldout_pass_at_1": sw.spread([0.445, 0.418])},
             "m2po": {"heldout_pass_at_1": sw.spread([0.488, 0.129])},
             "sapo": {"heldout_pass_at_1": sw.spread([0.445, None])}}
    rec = sw.recommend_level(cells, seeds=[0, 1])
    assert rec["best"] == "m2po" and rec["lead_over_default"] == pytest.approx(-0.123)
    assert rec["pick"] == "default" and rec["separable"] is False
    assert rec["verdict"] == "cannot separate at this scale (m2po led on seeds [0], default on the 2 they share)"


def test_recommendation_without_a_seed_every_stabiliser_has_ranks_by_mean():
    cells = {"default": {"heldout_pass_at_1": sw.spread([0.4, None])},
             "vcpo": {"heldout_pass_at_1": sw.spread([None, 0.6])}}
    rec = sw.recommend_level(cells, seeds=[3, 4])
    assert rec["best"] == "vcpo" and rec["selected_on_seeds"] == [] and rec["lead_over_default"] is None
    assert rec["seeds"] == 0 and rec["pick"] == "default" and "no seed shared with default" in rec["verdict"]


# ------------------------------------------------------------------------------ resuming, plot, command line


def _store(out: Path, name: str, level: int, seed: int, steps: int, job: Path, spec: dict,
           heldout_prompts: int | None = sw.HELDOUT_PROMPTS) -> None:
    d = out / name / f"s{level}" / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs([0.1] * steps)))
    result = {"source_job": str(job), "derived_spec": spec}
    if heldout_prompts is not None:
        result["heldout"] = {"prompts": heldout_prompts, "pass_at_1": 0.25}
    (d / "result.json").write_text(json.dumps(result))


def test_a_finished_cell_is_reused_only_for_the_same_job_spec_and_enough_steps(local, tmp_path):
    spec = sw.derive(local, "m2po", 2)["spec"]
    _store(tmp_path, "m2po", 2, 0, 6, LOCAL, spec)
    assert sw.run_dir(tmp_path, sw.cell_name("m2po", 2), 0) == tmp_path / "m2po" / "s2" / "seed0"
    found = sw.load_cell(tmp_path, "m2po", 2, 0, 4, LOCAL, spec)
    assert found is not None and len(found["records"]) == 4
    assert sw.load_cell(tmp_path, "m2po", 2, 0, 8, LOCAL, spec) is None  # too short
    assert sw.load_cell(tmp_path, "m2po", 2, 0, 4, LOCAL, sw.derive(local, "m2po", 8)["spec"]) is None
    assert sw.load_cell(tmp_path, "m2po", 2, 0, 4, tmp_path / "other.yaml", spec) is None
    assert sw.load_cell(tmp_path, "m2po", 2, 1, 4, LOCAL, spec) is None
    assert sw.load_cell(tmp_path, "m2po", 2, 0, 4, LOCAL, spec, heldout_prompts=64) is None  # other prompts


def test_a_cell_measured_before_the_heldout_figure_is_run_again_unless_asked_for_none(local, tmp_path):
    spec = sw.derive(local, "tba", 8)["spec"]
    _store(tmp_path, "tba", 8, 0, 12, LOCAL, spec, heldout_prompts=None)
    assert sw.load_cell(tmp_path, "tba", 8, 0, 12, LOCAL, spec) is None
    assert sw.load_cell(tmp_path, "tba", 8, 0, 12, LOCAL, spec, heldout_prompts=0) is not None


def test_run_cell_evaluates_the_final_policy_before_deleting_the_weights(local, tmp_path, monkeypatch):
    calls = []

    def fake_run(job, eta, seed, steps, d):  # what `asyncrl run` leaves: weights, checkpoints, run.json
        final = d / "run" / "weights" / f"v{steps}"
        final.mkdir(parents=True)
        (final / "model.safetensors").write_bytes(b"w" * 10)
        (d / "run" / "checkpoints").mkdir()
        (d / "run" / "job.yaml").write_text((d / "job.yaml").read_text())
        (d / "run" / "run.json").write_text(json.dumps({"final_weights": str(final)}))
        (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs([0.1] * steps)))
        return {"job": str(job), "eta": eta, "seed": seed, "steps": steps}

    def fake_evaluate(model, job, extra):
        assert Path(model, "model.safetensors").exists(), "evaluated after the weights were deleted"
        calls.append((Path(model).name, Path(job).name, extra))
        return {"prompts": 256, "pass_at_1": 0.5, "policy_version": 3, "response_length": 11.25, "seconds": 9.0}

    monkeypatch.setattr(sw, "run_asyncrl", fake_run)
    monkeypatch.setattr(sw, "evaluate", fake_evaluate)
    doc = sw.derive(local, "bapo", 2)
    sw.run_cell(tmp_path, "bapo", 2, 0, 3, LOCAL, doc)
    assert calls and calls[0][:2] == ("v3", "job.yaml") and calls[0][2][:2] == ["--prompts", "256"]
    d = sw.run_dir(tmp_path, sw.cell_name("bapo", 2), 0)
    assert not (d / "run" / "weights").exists() and not (d / "run" / "checkpoints").exists()
    found = sw.load_cell(tmp_path, "bapo", 2, 0, 3, LOCAL, doc["spec"])
    assert found is not None and sw.heldout_pass_at_1(found) == 0.5


def test_a_measured_cell_keeps_its_figures_and_loses_its_weights(local, tmp_path):
    spec = sw.derive(local, "default", 0)["spec"]
    _store(tmp_path, "default", 0, 0, 4, LOCAL, spec)
    run = sw.run_dir(tmp_path, sw.cell_name("default", 0), 0) / "run"
    for part, size in (("weights/v3", 1000), ("checkpoints/step-3", 24)):
        (run / part).mkdir(parents=True)
        (run / part / "model.safetensors").write_bytes(b"x" * size)
    (run / "metrics.jsonl").write_text("{}\n")
    assert sw.prune_run(run.parent) == 1024
    assert not (run / "weights").exists() and not (run / "checkpoints").exists()
    assert (run / "metrics.jsonl").exists()
    assert sw.load_cell(tmp_path, "default", 0, 0, 4, LOCAL, spec) is not None
    assert sw.prune_run(run.parent) == 0  # nothing left to free; no error


def test_plot_series_has_a_panel_per_level_and_skips_without_matplotlib(tmp_path, monkeypatch):
    series = sw.sweep_series(_cell_results(), [0, 2])
    assert list(series) == ["0", "2"] and sorted(series["2"]) == ["default", "m2po", "vcpo"]
    assert list(series["0"]) == ["default"] and series["2"]["m2po"]["seeds"] == 2
    assert series["2"]["vcpo"]["reward_ma"][-1] == pytest.approx(0.45)  # mean of 0.0 and 0.9
    monkeypatch.setattr(sw, "TRL_VENV", tmp_path / "no-venv")
    assert sw.plot_python(None, explicit=False) is None
    assert sw.plot_python(Path("/some/python"), explicit=False) == Path("/some/python")
    msg = sw.write_plot(series, tmp_path / "p.png", tmp_path, "t", None)
    assert msg.startswith("not drawn") and json.loads((tmp_path / "plot_series.json").read_text())["series"] == series
    assert not (tmp_path / "p.png").exists()


def test_heldout_bars_are_the_evaluated_seeds_per_level():
    bars = sw.sweep_heldout(_cell_results(), [0, 2, 8])
    assert bars == {"0": {"default": [0.5, 0.4]}, "2": {"default": [0.3, 0.3], "m2po": [0.6, 0.7], "vcpo": [0.8]},
                    "8": {}}


@pytest.mark.parametrize("with_heldout", [False, True])
def test_render_plot_draws_a_png(tmp_path, with_heldout):
    pytest.importorskip("matplotlib")
    heldout = sw.sweep_heldout(_cell_results(), [0, 2]) if with_heldout else None
    sw.render_plot(sw.sweep_series(_cell_results(), [0, 2]), tmp_path / "p.png", "title", heldout=heldout)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_settings_cpu_defaults_full_and_explicit_flags():
    cpu = sw.settings(sw.build_parser().parse_args([]))
    assert cpu == {"stabilisers": ["default", "tba"], "levels": [0, 2, 8], "seeds": [0, 1],
                   "steps": 12, "device": None}
    full = sw.settings(sw.build_parser().parse_args(["--full"]))
    assert full["stabilisers"] == list(sw.STABILISERS) and full["seeds"] == [0, 1, 2]
    assert full["steps"] == 40 and full["device"] == "auto"
    mine = sw.settings(sw.build_parser().parse_args(["--full", "--seeds", "3", "--staleness", "0, 4",
                                                     "--stabilisers", "default,tba", "--steps", "2"]))
    assert mine == {"stabilisers": ["default", "tba"], "levels": [0, 4], "seeds": [3], "steps": 2, "device": "auto"}
    every = sw.settings(sw.build_parser().parse_args(["--stabilisers", "all"]))
    assert every["stabilisers"] == list(sw.STABILISERS)


def test_no_train_summarises_the_stored_cells_and_lists_the_missing(local, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--no-train must not train")

    monkeypatch.setattr(sw, "run_cell", refuse)
    _store(tmp_path, "default", 8, 0, 4, LOCAL, sw.derive(local, "default", 8)["spec"])
    results, failed, missing = sw.sweep(local, LOCAL, tmp_path, ["default", "m2po"], [8], [0, 1], 4, None,
                                        train=False)
    assert list(results) == ["default"] and list(results["default"][8]) == [0]
    assert sorted(missing) == ["default/s8/seed1", "m2po/s8/seed0", "m2po/s8/seed1"]
    assert failed == {}


def test_unknown_stabiliser_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        sw.main(["--stabilisers", "default,nope"])
    assert exc.value.code == 2 and "unknown stabiliser(s) nope" in capsys.readouterr().err


def test_help_names_the_commands_and_imports_nothing_heavy():
    res = subprocess.run([sys.executable, str(BENCHMARKS / "staleness_sweep.py"), "--help"],
                         capture_output=True, text=True, check=True)
    for words in ("--stabilisers", "--staleness", "--full", "weightSyncLag", "cannot separate at this scale",
                  ".venv/bin/python benchmarks/staleness_sweep.py", *sw.STABILISERS):
        assert words in res.stdout, words
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import staleness_sweep; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'asyncrl', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
