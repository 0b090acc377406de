"""`asyncrl eval`: the real SmolLM2-135M on CPU, on the base model and on trainer-format weights
directories; a table and one JSON line; the job's settings; clear errors, never a traceback."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import load_job
from asyncrl.cli import build_parser, main
from asyncrl.rollout.evaluation.command import plan_from_args
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO

pytestmark = pytest.mark.slow

BASE = "embedded:SmolLM2-135M-Instruct"
# Questions the base model answers right (greedy) 5 times in 6, so pass@1 says something.
EASY = [("What is 2 + 2?", "4"), ("What is 1 + 1?", "2"), ("What is 10 + 10?", "20"),
        ("What is 3 + 4?", "7"), ("What is 5 + 5?", "10"), ("What is 100 + 1?", "101")]


def run_eval(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["eval", *argv])
    return rc, out.getvalue(), err.getvalue()


def local_job(tmp_path: Path, *, evaluation: dict, dataset: dict | None = None) -> Path:
    """examples/local.yaml with this evaluation section (and dataset fields) set."""
    doc = JobBuilder.example("local").doc()
    doc["spec"]["evaluation"] = evaluation
    doc["spec"]["dataset"].update(dataset or {})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def easy_jsonl(module_dir: Path) -> Path:
    path = module_dir / "easy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{q} Answer with just the final number.", "answer": a}) + "\n"
                            for q, a in EASY))
    return path


@pytest.fixture(scope="module")
def base_on_easy(easy_jsonl) -> dict:
    rc, out, err = run_eval(BASE, "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    return last_json(out)


FIGURES = ("reward_mean", "pass_at_1", "pass_at_k", "k", "prompts", "samples", "response_length")


def figures(record: dict) -> dict:
    return {k: record[k] for k in FIGURES}


# ------------------------------------------------------------------------------------ the command


def test_base_model_prints_a_table_a_progress_bar_and_one_json_line(tmp_path):
    """The real entry point, as a user runs it: exit 0, table, bar on stderr, JSON last, --json-out."""
    out_file = tmp_path / "eval.json"
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", BASE, "--prompts", "4",
                          "--max-new-tokens", "8", "--threads", "1", "--json-out", str(out_file)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    record = last_json(res.stdout)
    assert record["prompts"] == 4 and record["k"] == 1 and record["samples"] == 4
    assert record["model"] == BASE and record["dataset"] == "builtin:arithmetic" and record["split"] == "test"
    assert record["policy_version"] == 0 and record["pass_at_k"] is None
    assert 0 <= record["pass_at_1"] <= 1 and 1 <= record["response_length"] <= 8
    table = res.stdout.strip().splitlines()[:-1]
    for label in ("model", "dataset", "prompts", "reward mean", "pass@1", "pass@k", "mean length", "seconds"):
        assert any(label in line for line in table), (label, res.stdout)
    assert "4/4" in res.stderr  # the progress bar: answers done / total
    assert json.loads(out_file.read_text()) == record


def test_greedy_evaluation_of_the_same_model_is_repeatable(easy_jsonl, base_on_easy):
    rc, out, err = run_eval(BASE, "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    assert figures(last_json(out)) == figures(base_on_easy)
    assert base_on_easy["prompts"] == len(EASY) and base_on_easy["dataset"] == str(easy_jsonl)
    assert 0 < base_on_easy["pass_at_1"] < 1, "the easy set must separate right from wrong answers"


def test_sampling_reports_pass_at_k(easy_jsonl):
    rc, out, err = run_eval(BASE, "--dataset", str(easy_jsonl), "--prompts", "2", "--samples-per-prompt", "3",
                            "--temperature", "1.0", "--max-new-tokens", "8", "--seed", "1")
    assert rc == 0, err
    record = last_json(out)
    assert record["k"] == 3 and record["samples"] == 6 and record["prompts"] == 2
    assert record["pass_at_k"] is not None and record["pass_at_k"] >= record["pass_at_1"]
    assert "pass@3" in out and "6/6" in err


def test_trainer_format_weights_directories(tmp_path, easy_jsonl, base_on_easy):
    """`weights/vN` as the trainer writes it: the same weights give the same figures (reported as
    version N); damaged weights give different ones, so the directory's weights are the ones used."""
    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer
    from asyncrl.trainer.weights.files import write_weights

    model, tokenizer = load_causal_lm(BASE), load_tokenizer(BASE)
    same = write_weights(model, tokenizer, tmp_path / "weights", 3)
    rc, out, err = run_eval(str(same), "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    record = last_json(out)
    assert record["policy_version"] == 3 and record["model"] == str(same)
    assert figures(record) == figures(base_on_easy)

    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    damaged = write_weights(model, tokenizer, tmp_path / "weights", 4)
    rc, out, err = run_eval(str(damaged), "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    assert last_json(out)["pass_at_1"] < base_on_easy["pass_at_1"]


def test_lora_adapter_versions(tmp_path, easy_jsonl, base_on_easy):
    """A LoRA job's `weights/vN` (an adapter directory) is served on the base model its config names:
    an untrained adapter (B = 0) gives the base model's figures, a damaged one different figures."""
    import torch

    from asyncrl.api.spec.lora import LoraSpec
    from asyncrl.infra.hf_models import load_causal_lm
    from asyncrl.trainer.lora import add_adapters
    from asyncrl.trainer.weights.files import write_weights

    model = add_adapters(load_causal_lm(BASE), LoraSpec(rank=4, alpha=8), base_model=BASE)
    fresh = write_weights(model, None, tmp_path / "weights", 5)
    rc, out, err = run_eval(str(fresh), "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    record = last_json(out)
    assert record["policy_version"] == 5 and figures(record) == figures(base_on_easy)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(1.0)
    damaged = write_weights(model, None, tmp_path / "weights", 6)
    rc, out, err = run_eval(str(damaged), "--dataset", str(easy_jsonl), "--max-new-tokens", "16")
    assert rc == 0, err
    assert last_json(out)["pass_at_1"] < base_on_easy["pass_at_1"]


# ------------------------------------------------------------------------------------ job settings


def test_local_example_job_settings_are_the_defaults():
    job = load_job(REPO / "examples" / "local.yaml").spec
    plan = plan_from_args(build_parser().parse_args(["eval", BASE, "--config", str(REPO / "examples/local.yaml")]))
    if job.evaluation is None:  # the job's own dataset, held-out split, reward and answer length
        assert plan.spec.dataset.source == job.dataset.source and plan.spec.dataset.split == "test"
        assert plan.spec.dataset.difficulty == job.dataset.difficulty and plan.spec.dataset.seed == job.dataset.seed
        assert plan.spec.prompts == 64 and plan.spec.temperature == 0
    else:
        assert plan.spec.dataset == job.evaluation.dataset
        assert plan.spec.prompts == job.evaluation.prompts
        assert plan.spec.temperature == job.evaluation.temperature
    assert plan.spec.reward is not None and plan.spec.reward.function == job.reward.function
    assert plan.spec.max_new_tokens == ((job.evaluation and job.evaluation.max_new_tokens)
                                        or job.algorithm.max_new_tokens)
    assert plan.tokenizers[0] in (BASE, job.model.tokenizer)

    rc, out, err = run_eval(BASE, "--config", str(REPO / "examples/local.yaml"), "--prompts", "2",
                            "--max-new-tokens", "8")
    assert rc == 0, err
    record = last_json(out)
    assert record["prompts"] == 2 and record["dataset"] == plan.spec.dataset.source
    assert record["split"] == plan.spec.dataset.split and record["response_length"] <= 8


def test_a_jobs_evaluation_section_template_and_system_prompt_are_used(tmp_path, easy_jsonl):
    job_file = local_job(tmp_path, evaluation={"dataset": {"source": str(easy_jsonl)}, "prompts": 3,
                                               "maxNewTokens": 4, "everySteps": 7},
                         dataset={"promptTemplate": "Question: {prompt}", "systemPrompt": "You are a calculator."})

    plan = plan_from_args(build_parser().parse_args(["eval", BASE, "--config", str(job_file)]))
    assert plan.prompt_template == "Question: {prompt}" and plan.system_prompt == "You are a calculator."
    assert plan.spec.dataset.source == str(easy_jsonl) and plan.spec.prompts == 3

    rc, out, err = run_eval(BASE, "--config", str(job_file))
    assert rc == 0, err
    record = last_json(out)
    assert record["prompts"] == 3 and record["dataset"] == str(easy_jsonl)
    assert 1 <= record["response_length"] <= 4  # the section's maxNewTokens, not the job's 32
    rc, out, err = run_eval(BASE, "--config", str(job_file), "--prompts", "1", "--max-new-tokens", "2")
    assert rc == 0, err
    assert last_json(out)["prompts"] == 1 and last_json(out)["response_length"] <= 2  # flags win


# ------------------------------------------------------------------------------------ errors


def _error(rc_expected: int, *argv: str) -> str:
    rc, out, err = run_eval(*argv)
    assert rc == rc_expected, (rc, out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl eval: error: "), err
    return lines[0]


def test_a_missing_model_directory_is_named(tmp_path):
    line = _error(1, str(tmp_path / "weights" / "v9"))
    assert "MODEL_DIR" in line and "no such directory" in line and "embedded:SmolLM2-135M-Instruct" in line


def test_a_directory_that_is_not_a_model_is_named(tmp_path):
    assert "no config.json" in _error(1, str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert "not a Hugging Face model directory" in _error(1, str(tmp_path))
    assert "unknown embedded model 'Nope'" in _error(1, "embedded:Nope")


def test_several_samples_need_a_temperature():
    line = _error(2, BASE, "--samples-per-prompt", "4")
    assert "--samples-per-prompt" in line and "needs temperature > 0" in line
    assert "allowed: samplesPerPrompt 1 with temperature 0, or temperature > 0" in line


@pytest.mark.parametrize(("argv", "words"), [
    (["--prompts", "0"], ["--prompts", "greater than or equal to 1", "got 0"]),
    (["--difficulty", "9"], ["--difficulty", "less than or equal to 5"]),
    (["--split", "dev"], ["--split", "allowed train, test"]),
    (["--reward", "nope"], ["--reward", "allowed: gsm8k, exact-number, or module:function"]),
    (["--reward", "no_such_module:score"], ["--reward", "cannot import module 'no_such_module'"]),
    (["--threads", "-1"], ["--threads", ">= 0"]),
], ids=["prompts", "difficulty", "split", "reward", "reward-plugin", "threads"])
def test_bad_flag_values_name_the_flag_and_what_is_allowed(argv, words):
    line = _error(2, BASE, *argv)
    for word in words:
        assert word in line, line


def test_an_unreadable_dataset_is_named(tmp_path):
    line = _error(1, BASE, "--dataset", str(tmp_path / "missing.jsonl"))
    assert "--dataset" in line and "does not exist" in line
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert "not JSON" in _error(1, BASE, "--dataset", str(tmp_path / "bad.jsonl"))


def test_a_bad_job_file_is_explained(tmp_path, capsys):
    job = local_job(tmp_path, evaluation={"samplesPerPrompt": 4})
    assert main(["eval", BASE, "--config", str(job)]) == 1
    err = capsys.readouterr().err
    assert "evaluation" in err and "needs temperature > 0" in err and "Traceback" not in err


def test_choices_are_checked_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", BASE, "--device", "tpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and "'cpu'" in err and "'cuda'" in err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    for flag in ("MODEL_DIR", "--config", "--dataset", "--format", "--split", "--difficulty", "--reward", "--prompts",
                 "--samples-per-prompt", "--temperature", "--max-new-tokens", "--seed", "--json-out", "--threads",
                 "--device", "--dtype", "--tokenizer"):
        assert flag in text, flag
    assert "embedded:SmolLM2-135M-Instruct" in text and "pass@K" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "eval" in capsys.readouterr().out
