"""Dataset mixtures (spec.datasets): the weighted, seeded draw, the spec's rules, and the rollout worker
drawing from two sources with a reward each, resuming every source where it was after a restart."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.status_report import EvalRecord, TrainerReport
from asyncrl.cli import build_parser
from asyncrl.local.runner import configure, prepare_job
from asyncrl.rollout.data.datasets import ArithmeticSource
from asyncrl.rollout.data.mixture import BLOCK, Lane, Mixture, MixtureDraw
from asyncrl.rollout.evaluation.command import plan_from_args, print_result
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.process import StartupError, evaluation_inputs, training_inputs
from asyncrl.trainer.report.prometheus import TrainerMetrics
from asyncrl.trainer.report.trackers import Trackers
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO
from tests.support.reward_services import half_reward
from tests.support.rollout_workers import make_worker, published, render
from tests.support.trainer_support import ASYNCRL, read_jsonl


def within_binomial_noise(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_sources_are_drawn_by_weight_and_each_position_of_a_source_once() -> None:
    draw = MixtureDraw([3.0, 1.0], seed=7)
    n = 3 * BLOCK + 17  # (across block boundaries)
    places = [draw.where(g) for g in range(n)]
    counts = Counter(source for source, _ in places)
    assert within_binomial_noise(counts[0], n, 0.75)
    for source in (0, 1):  # every source walked in order from 0, no position twice, none skipped
        assert sorted(local for s, local in places if s == source) == list(range(counts[source]))
    first_of_1 = [local for s, local in places if s == 1]
    assert first_of_1 == sorted(first_of_1)


def test_the_draw_depends_on_the_seed_only_and_not_on_the_order_of_reads() -> None:
    reader = MixtureDraw([2, 1, 1], seed=3)
    forwards = [reader.where(g) for g in range(2 * BLOCK)]
    backwards = MixtureDraw([2, 1, 1], seed=3)
    assert [backwards.where(g) for g in reversed(range(2 * BLOCK))][::-1] == forwards
    far = MixtureDraw([2, 1, 1], seed=3)
    assert far.where(2 * BLOCK - 1) == forwards[-1]  # (a worker resuming far in: no walk from 0 needed first)
    other = MixtureDraw([2, 1, 1], seed=4)
    assert [other.where(g) for g in range(2 * BLOCK)] != forwards


def test_one_source_takes_every_position_itself() -> None:
    draw = MixtureDraw([5.0], seed=1)
    assert [draw.where(g) for g in (0, 1, 10**9)] == [(0, 0), (0, 1), (0, 10**9)]


@pytest.mark.parametrize("weights", [[], [1.0, 0.0], [1.0, -2.0], [math.nan]])
def test_weights_must_be_positive(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        MixtureDraw(weights, seed=0)


# ------------------------------------------------------------------------------------------ spec

MIXTURE = [{"name": "easy", "weight": 3, "source": "builtin:arithmetic", "difficulty": 1},
           {"name": "hard", "weight": 1, "source": "builtin:arithmetic", "difficulty": 3,
            "reward": {"function": "gsm8k"}}]


def mixture_job(datasets: list[dict] | None = None, **spec: object) -> dict:
    doc = JobBuilder.example().doc()
    doc["spec"].pop("dataset", None)
    doc["spec"]["datasets"] = MIXTURE if datasets is None else datasets
    doc["spec"].update(spec)
    return doc


def spec_error(doc: dict) -> str:
    with pytest.raises(ValidationError) as info:
        AsyncRLJob.model_validate(doc)
    return str(info.value)


def test_a_mixture_job_validates_and_survives_its_own_job_file() -> None:
    job = AsyncRLJob.model_validate(mixture_job())
    assert job.spec.dataset is None and [d.name for d in job.spec.datasets or []] == ["easy", "hard"]
    # the file the operator writes for the pods (every default filled in) validates again, unchanged
    again = AsyncRLJob.model_validate(yaml.safe_load(yaml.safe_dump(job.to_wire())))
    assert again.spec == job.spec
    single = AsyncRLJob.model_validate(JobBuilder.example().doc())
    assert single.spec.dataset is not None and single.spec.datasets is None


def test_dataset_and_datasets_are_exclusive() -> None:
    message = spec_error(mixture_job(dataset={"source": "builtin:arithmetic"}))
    assert "set dataset (one source) or datasets (a mixture), not both" in message


def test_source_names_are_unique_and_label_safe() -> None:
    twice = [{**MIXTURE[0]}, {**MIXTURE[1], "name": "easy"}]
    assert "name 'easy' is used more than once" in spec_error(mixture_job(twice))
    bad = [{**MIXTURE[0], "name": "Easy Set"}]
    assert "datasets.0.name" in spec_error(mixture_job(bad))


@pytest.mark.parametrize("weight", [0, -1, "inf"])
def test_weights_are_positive_and_finite(weight: object) -> None:
    assert "datasets.0.weight" in spec_error(mixture_job([{**MIXTURE[0], "weight": weight}]))


def test_a_sources_reward_service_is_a_url() -> None:
    deployed = [{**MIXTURE[0], "reward": {"service": {"deployment": {}}}}]
    assert "a source's reward.service takes a url only" in spec_error(mixture_job(deployed))
    AsyncRLJob.model_validate(mixture_job([{**MIXTURE[0], "reward": {"service": {"url": "http://r:8100"}}}]))


# ---------------------------------------------------------------------------------------- worker


def two_sources() -> Mixture:
    easy = Lane("easy", ArithmeticSource(seed=0, difficulty=1), render, RewardScorer(exact_number_reward, 5.0))
    hard = Lane("hard", ArithmeticSource(seed=0, difficulty=3), render, RewardScorer(half_reward, 5.0))
    return Mixture([easy, hard], [3.0, 1.0], seed=11)


async def test_a_worker_draws_both_sources_scores_each_its_way_and_resumes_each_after_a_restart(rollout_env):
    redis, fake, names = rollout_env
    first = make_worker(redis, fake, names, n=2, max_new=4, max_groups=12, batch=100, max_concurrent=4,
                        prompts=two_sources())
    await asyncio.wait_for(first.run(), 60)
    before = await published(redis, names)
    assert len(before) == 12
    second = make_worker(redis, fake, names, n=2, max_new=4, max_groups=12, batch=100, max_concurrent=4,
                         prompts=two_sources())
    await asyncio.wait_for(second.run(), 60)
    groups = await published(redis, names)
    assert len(groups) == 24

    by_source: dict[str, list[str]] = {"easy": [], "hard": []}
    for g in groups:
        by_source[g.source].append(g.prompt_id)
        if g.source == "hard":
            assert {s.reward for s in g.samples} == {0.5}
        else:
            assert {s.reward for s in g.samples} <= {0.0, 1.0}
    # the draw of the same 24 positions, made independently: the worker took exactly those prompts,
    # so no prompt of either source was repeated or skipped across the restart
    draw = two_sources()
    want: dict[str, list[str]] = {"easy": [], "hard": []}
    for position in range(24):
        lane, item = draw.pick(position)
        want[lane.name].append(item.prompt_id)
    assert {k: sorted(v) for k, v in by_source.items()} == {k: sorted(v) for k, v in want.items()}
    assert len({g.prompt_id for g in groups}) == 24
    assert by_source["easy"] and by_source["hard"]


# ------------------------------------------------------------------------------------- a whole run


@pytest.mark.slow
def test_a_local_run_trains_a_3_to_1_mixture_and_reports_each_source(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`asyncrl run` on two sources weighted 3:1, each with its own reward: the trained groups come
    from both in proportion (within binomial noise), and metrics.jsonl and the report count them
    (on the two-layer model: the mixture's path, not what the model learns, is under test)."""
    job = JobBuilder.small(name="t-mix", batch_size=8, group_size=2, eta=1, max_steps=4, max_new_tokens=4,
                           model={"path": str(tiny_model_dir)})
    doc = job.doc()
    doc["spec"].pop("dataset")
    doc["spec"]["datasets"] = [
        {"name": "add", "weight": 3, "source": "builtin:arithmetic", "difficulty": 1},
        {"name": "mul", "weight": 1, "source": "builtin:arithmetic", "difficulty": 3,
         "reward": {"function": "tests.support.reward_services:half_reward"}}]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(ASYNCRL + ["run", str(path), "--max-steps", "4", "--run-dir", str(run_dir), "--no-progress"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    counts: Counter[str] = Counter()
    for m in lines:
        assert sum(m["groups_by_source"].values()) == 8
        assert set(m["reward_by_source"]) == set(m["groups_by_source"])
        if "mul" in m["reward_by_source"]:
            assert m["reward_by_source"]["mul"] == 0.5  # (its own reward)
        counts.update(m["groups_by_source"])
    assert counts["add"] + counts["mul"] == 32 and counts["mul"] > 0
    assert within_binomial_noise(counts["add"], 32, 0.75)
    state = json.loads(max((run_dir / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["report"]["groups_by_source"] == dict(counts)


def test_a_bad_source_fails_the_worker_at_start_naming_it(tmp_path: Path) -> None:
    missing = [MIXTURE[0], {**MIXTURE[1], "source": str(tmp_path / "none.jsonl"), "format": "gsm8k"}]
    spec = AsyncRLJob.model_validate(mixture_job(missing)).spec
    with pytest.raises(StartupError, match=r"spec.datasets\[1\] \(hard\): .*none.jsonl does not exist"):
        training_inputs(spec)
    unknown = [MIXTURE[0], {**MIXTURE[1], "reward": {"function": "nowhere.at_all:reward"}}]
    with pytest.raises(StartupError, match=r"spec.datasets\[1\].reward \(hard\): .*nowhere.at_all"):
        training_inputs(AsyncRLJob.model_validate(mixture_job(unknown)).spec)
    inputs = training_inputs(AsyncRLJob.model_validate(mixture_job()).spec)
    assert [(i.name, i.weight) for i in inputs] == [("easy", 3.0), ("hard", 1.0)]
    assert inputs[0].scorer is not inputs[1].scorer  # ("hard" scores its own way)


def test_run_seed_flag_reseeds_every_source(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(mixture_job()))
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([str(path), "--seed", "5"])
    job, data = prepare_job(args)
    assert job.spec.seed == 5 and [d.seed for d in job.spec.datasets or []] == [5, 5]
    assert "dataset" not in data["spec"]


# ------------------------------------------------------------------------------- held-out, per source

EVAL_SOURCES = [{"name": "easy", "source": "builtin:arithmetic", "difficulty": 1},
                {"name": "hard", "source": "builtin:arithmetic", "difficulty": 3},
                {"name": "other", "source": "builtin:arithmetic", "difficulty": 2,
                 "reward": {"function": "tests.support.reward_services:digit_sum_reward"}}]


def test_evaluation_datasets_follow_the_rules_of_a_list_of_sources() -> None:
    both = mixture_job(evaluation={"dataset": {"source": "builtin:arithmetic"}, "datasets": EVAL_SOURCES})
    assert "set evaluation.dataset (one source) or evaluation.datasets, not both" in spec_error(both)
    twice = mixture_job(evaluation={"datasets": [EVAL_SOURCES[0], EVAL_SOURCES[0]]})
    assert "name 'easy' is used more than once" in spec_error(twice)
    deployed = mixture_job(evaluation={"datasets": [{**EVAL_SOURCES[0], "reward": {"service": {"deployment": {}}}}]})
    assert "an evaluation source's reward.service takes a url only" in spec_error(deployed)
    job = AsyncRLJob.model_validate(mixture_job(evaluation={"datasets": EVAL_SOURCES}))
    assert job.spec.evaluation is not None and job.spec.evaluation.dataset is None
    assert [d.split for d in job.spec.evaluation.datasets or []] == ["test"] * 3  # (held out by default)
    assert AsyncRLJob.model_validate(yaml.safe_load(yaml.safe_dump(job.to_wire()))).spec == job.spec


def test_each_eval_source_is_scored_by_its_own_reward_else_its_training_namesakes_else_the_jobs() -> None:
    spec = AsyncRLJob.model_validate(mixture_job(evaluation={"datasets": EVAL_SOURCES, "prompts": 3},
                                                 reward={"function": "exact-number"})).spec
    inputs = evaluation_inputs(spec)
    assert inputs is not None and [i.part.name for i in inputs] == ["easy", "hard", "other"]
    assert all(len(i.part.items) == 3 for i in inputs)
    scorers = {i.part.name: i.part.scorer for i in inputs}
    assert scorers["hard"].name == "gsm8k"  # (the training source "hard"'s reward)
    assert scorers["easy"].name == "exact-number"  # (no reward of its namesake: the job's)
    assert scorers["other"].name.endswith(":digit_sum_reward")  # (its own)
    # the prompt format falls back on the training namesake's, else on the first source's
    assert inputs[1].training.name == "hard" and inputs[2].training.name == "easy"
    bad = mixture_job(evaluation={"datasets": [{**EVAL_SOURCES[1], "source": "/nowhere/x.jsonl"}]})
    with pytest.raises(StartupError, match=r"spec.evaluation.datasets \(hard\) \(/nowhere/x.jsonl, split test\)"):
        evaluation_inputs(AsyncRLJob.model_validate(bad).spec)


def test_asyncrl_eval_of_a_job_with_eval_sources_keeps_each_sources_reward(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(mixture_job(evaluation={"datasets": EVAL_SOURCES})))
    plan = plan_from_args(build_parser().parse_args(["eval", "embedded:SmolLM2-135M-Instruct", "--config", str(path)]))
    rewards = {d.name: d.reward.function if d.reward else None for d in plan.spec.datasets or []}
    assert rewards == {"easy": None, "hard": "gsm8k", "other": "tests.support.reward_services:digit_sum_reward"}
    one = plan_from_args(build_parser().parse_args(["eval", "embedded:SmolLM2-135M-Instruct", "--config", str(path),
                                                    "--dataset", "builtin:arithmetic", "--difficulty", "4"]))
    assert one.spec.datasets is None and one.spec.dataset is not None and one.spec.dataset.difficulty == 4


def test_each_eval_sources_figures_reach_prometheus_and_the_trackers() -> None:
    newest = EvalRecord(policy_version=4, reward_mean=0.5, pass_at_1=0.5, prompts=4, samples=4,
                        pass_at_1_by_source={"easy": 0.75, "hard": 0.25}, reward_by_source={"easy": 0.75, "hard": 0.3})
    metrics = TrainerMetrics()
    metrics.update(TrainerReport(evaluations=[newest]))
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert samples[("asyncrl_eval_pass_at_1_by_source", (("source", "easy"),))] == 0.75
    assert samples[("asyncrl_eval_reward_by_source", (("source", "hard"),))] == 0.3
    metrics.update(TrainerReport(evaluations=[newest.model_copy(update={"pass_at_1_by_source": {},
                                                                        "reward_by_source": {}})]))
    assert "asyncrl_eval_pass_at_1_by_source{" not in generate_latest(metrics.registry).decode()

    class Recorder:
        name = "recorder"
        logged: ClassVar[list[dict[str, float]]] = []

        def begin(self, step: int) -> None: ...

        def log(self, step: int, values: dict[str, float]) -> None:
            self.logged.append(values)

        def close(self) -> None: ...

    recorder = Recorder()
    Trackers([recorder]).log_eval(7, newest)
    [values] = recorder.logged
    assert values["eval/pass_at_1/easy"] == 0.75 and values["eval/reward_mean/hard"] == 0.3


def test_asyncrl_eval_prints_each_sources_figures(capsys: pytest.CaptureFixture[str]) -> None:
    record = EvalRecord(policy_version=0, reward_mean=0.5, pass_at_1=0.5, prompts=4, samples=4,
                        pass_at_1_by_source={"easy": 0.75, "hard": 0.25}, reward_by_source={"easy": 0.75, "hard": 0.3})
    result = {**record.model_dump(), "model": "m", "dataset": "easy: builtin:arithmetic (test), hard: x.jsonl (test)",
              "split": ""}
    print_result(result)
    out = capsys.readouterr().out
    assert "pass@1 · easy" in out and "0.7500 (reward 0.7500)" in out and "0.2500 (reward 0.3000)" in out
    assert "hard: x.jsonl (test)" in out and "(test) ()" not in out
    assert json.loads(out.strip().splitlines()[-1])["pass_at_1_by_source"] == {"easy": 0.75, "hard": 0.25}
