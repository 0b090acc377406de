"""LoRA (spec.trainer.lora) on the real SmolLM2-135M: adapters injected, trained, published as PEFT
directories, hot-loaded by the hf engine with the version on its answers, checkpointed as the adapter."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.spec.lora import LoraSpec
from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, resolve_model_path
from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, load_into, read_adapter
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.hf_engine import HFEngine, WeightUpdateError
from asyncrl.trainer.lora import TargetModulesError, add_adapters, trainable_parameters
from asyncrl.trainer.state.checkpoint import (
    CheckpointMismatchError,
    TrainerState,
    load_checkpoint,
    model_identity,
    save_checkpoint,
)
from asyncrl.trainer.step.logprobs import token_logprobs
from asyncrl.trainer.weights.files import write_weights
from tests.support.lora_models import MODEL, adapted, logprobs, perturbed

pytestmark = pytest.mark.slow
EXAMPLE = "examples/local.yaml"


def job_with(**lora) -> AsyncRLJob:
    job = yaml.safe_load(open(EXAMPLE))
    job["spec"]["trainer"]["lora"] = lora
    return AsyncRLJob.model_validate(job)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------ spec


@pytest.mark.parametrize("lora, field", [
    ({"rank": 0}, "rank"), ({"rank": 2048}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"targetModules": []}, "targetModules"), ({"targetModules": ["q proj"]}, "targetModules"),
    ({"targetModules": ["all-linear", "q_proj"]}, "targetModules"),
])
def test_bad_lora_settings_are_refused_naming_the_field(lora, field):
    with pytest.raises(ValidationError) as err:
        job_with(**lora)
    assert f"spec.trainer.lora.{field}" in str(err.value)


def test_lora_is_refused_where_an_engine_or_the_transport_cannot_serve_it():
    job = yaml.safe_load(open(EXAMPLE))
    for engine in ("hf", "sglang", "vllm"):  # each engine hot-loads adapters
        job["spec"]["rollout"]["engine"] = engine
        job["spec"]["trainer"]["lora"] = {}
        AsyncRLJob.model_validate(job)
    job["spec"]["trainer"]["lora"] = {"rank": 1024}
    with pytest.raises(ValidationError, match=r"trainer\.lora\.rank with rollout\.engine vllm must be at most 512 "
                                              r"\(vLLM's largest --max-lora-rank\), got 1024"):
        AsyncRLJob.model_validate(job)
    job["spec"]["rollout"]["engine"] = "sglang"  # SGLang serves adapters on its own list of modules
    job["spec"]["trainer"]["lora"] = {"targetModules": ["q_proj", "c_attn"]}
    with pytest.raises(ValidationError, match=r"targetModules with rollout\.engine sglang must be all-linear or "
                                              r"modules SGLang serves adapters on: q_proj, .*; got c_attn"):
        AsyncRLJob.model_validate(job)
    job["spec"]["trainer"]["lora"] = {}
    job["spec"]["rollout"]["engine"] = "hf"
    job["spec"]["trainer"]["weightTransport"] = "collective"
    with pytest.raises(ValidationError, match=r"trainer\.lora needs trainer\.weightTransport disk"):
        AsyncRLJob.model_validate(job)


def test_a_target_module_the_model_lacks_is_named():
    model = load_causal_lm(MODEL, "float32", "cpu")
    with pytest.raises(TargetModulesError) as err:
        add_adapters(model, LoraSpec(target_modules=["q_proj", "qkv_proj"]), base_model=MODEL)
    assert "'qkv_proj'" in str(err.value) and "q_proj" in str(err.value) and "'q_proj'" not in \
        str(err.value).split("its linear layers")[0]


# ------------------------------------------------------------------------------------ trainer side


def test_only_the_adapters_train_and_a_version_is_a_small_peft_directory(tmp_path, prompt):
    from peft import PeftModel

    spec = job_with(rank=16, alpha=32).spec.trainer.lora
    model = adapted(spec)
    before = logprobs(model, prompt + [17, 18])
    base = load_causal_lm(MODEL, "float32", "cpu")
    assert torch.allclose(before, logprobs(base, prompt + [17, 18]), atol=1e-6), "a fresh adapter changes nothing"
    trained = trainable_parameters(model)
    assert trained and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in trained) < 0.05 * sum(p.numel() for p in base.parameters())

    perturbed(model)
    path = write_weights(model, None, tmp_path, 3)
    assert path == tmp_path / "v3" and sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    full = write_weights(base, None, tmp_path / "full", 0)
    adapter_bytes = sum(p.stat().st_size for p in path.iterdir())
    full_bytes = sum(p.stat().st_size for p in full.iterdir())
    assert adapter_bytes <= 0.05 * full_bytes, (adapter_bytes, full_bytes)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (16, 32, MODEL)

    # PEFT itself loads the directory onto the base model and computes what the trainer's model does
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*adapter keys.*")  # (PEFT only warns about names it cannot place)
        peft_model = PeftModel.from_pretrained(load_causal_lm(MODEL, "float32", "cpu"), str(path)).eval()
    seq = torch.tensor([prompt + [17, 18]])
    with torch.no_grad():
        peft_logits = peft_model(input_ids=seq).logits
        ours = model(input_ids=seq).logits
    assert torch.allclose(peft_logits, ours, atol=1e-4)
    assert not torch.allclose(logprobs(model, prompt + [17, 18]), before, atol=1e-3), "the adapter is trained"


def test_an_adapter_that_does_not_fit_changes_nothing(tmp_path, prompt):
    model = perturbed(adapted(LoraSpec(rank=8, alpha=16)))
    write_weights(model, None, tmp_path, 1)
    config, tensors = read_adapter(tmp_path / "v1")
    other = perturbed(adapted(LoraSpec(rank=8, alpha=16)), seed=5)
    reference = logprobs(other, prompt)
    wrong_rank = perturbed(adapted(LoraSpec(rank=4, alpha=16)))
    write_weights(wrong_rank, None, tmp_path, 2)
    with pytest.raises(AdapterError, match="rank 4"):
        load_into(other, *read_adapter(tmp_path / "v2"), "v2")
    bad = dict(tensors)
    name = next(iter(bad))
    bad[name] = bad[name][:1]
    with pytest.raises(AdapterError, match="shape"):
        load_into(other, config, bad, "v1")
    assert torch.equal(logprobs(other, prompt), reference)
    load_into(other, config, tensors, "v1")
    assert torch.allclose(logprobs(other, prompt), logprobs(model, prompt), atol=1e-6)


def test_a_checkpoint_holds_the_adapter_and_refuses_another_identity(tmp_path, prompt):
    job = job_with(rank=8, alpha=16)
    model = adapted(job.spec.trainer.lora)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    seq = torch.tensor([prompt + [17, 18]])
    lp, _ = token_logprobs(model, seq, torch.ones_like(seq), 1.0)
    (-lp.sum()).backward()
    optimizer.step()
    state = TrainerState(step=1, version=1, identity=model_identity(job.spec))
    path = save_checkpoint(tmp_path, model, optimizer, state)
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    full_bytes = sum(p.numel() * 4 for p in load_causal_lm(MODEL, "float32", "cpu").parameters())
    assert stored < 0.1 * full_bytes, "adapter + its AdamW state, not the frozen base"

    resumed = adapted(job.spec.trainer.lora, seed=7)
    resumed_opt = torch.optim.AdamW(trainable_parameters(resumed), lr=1e-3)
    got = load_checkpoint(path, resumed, resumed_opt, identity=model_identity(job.spec))
    assert got.step == 1
    assert torch.allclose(logprobs(resumed, prompt), logprobs(model, prompt), atol=1e-6)
    assert resumed_opt.state_dict()["state"], "the optimizer state came back"

    other = job_with(rank=4, alpha=16)
    with pytest.raises(CheckpointMismatchError, match="lora: checkpoint"):
        load_checkpoint(path, resumed, resumed_opt, identity=model_identity(other.spec))


# ------------------------------------------------------------------------------------ engine side


def test_the_hf_engine_hot_loads_each_version_and_labels_its_answers(tmp_path, prompt):
    model = adapted(LoraSpec(rank=8, alpha=16))
    engine = HFEngine(MODEL, max_batch_size=4, seed=3)
    try:
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        for version in (1, 2):
            perturbed(model, seed=version)
            write_weights(model, None, tmp_path, version)
            engine.pause("abort")
            engine.update_weights(str(tmp_path / f"v{version}"), version)
            engine.resume()
            result = engine.submit(prompt, params).result(timeout=120)
            assert result.weight_version == version
            expected = logprobs(model, prompt + result.output_ids)[len(prompt) - 1:]
            assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4), "served by this adapter"
        base_dir = resolve_model_path(MODEL)
        with pytest.raises(WeightUpdateError, match="serves LoRA adapters"):
            engine.update_weights(base_dir, 3)
        assert engine.weight_version == 2
    finally:
        engine.close()


# ------------------------------------------------------------------------------------ export


def test_export_merge_loads_in_transformers_and_matches_the_served_adapter(tmp_path, prompt):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    model = perturbed(adapted(LoraSpec(rank=8, alpha=16)))
    run = tmp_path / "run"
    write_weights(model, None, run / "weights", 1)
    write_weights(perturbed(model, seed=9), None, run / "weights", 2)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "export", str(run), str(merged), "--merge"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert f"exported {run / 'weights' / 'v2'}" in res.stdout
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    assert not list(merged.glob("adapter_*"))

    engine = HFEngine(MODEL, max_batch_size=2, seed=4)
    try:
        engine.update_weights(str(run / "weights" / "v2"), 2)
        served = engine.submit(prompt, SamplingParams(max_new_tokens=8, temperature=1.0)).result(timeout=120)
    finally:
        engine.close()
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    expected = logprobs(plain, prompt + served.output_ids)[len(prompt) - 1:]
    assert torch.allclose(torch.tensor(served.logprobs), expected, atol=1e-4)

    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "export", str(run / "weights" / "v1"), str(adapter)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    base = json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    assert base == resolve_model_path(MODEL), "an embedded base is named by the directory PEFT can load"

    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "export", str(run), str(merged)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "exists and is not empty" in res.stderr
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "export", str(tmp_path / "nothing"),
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "neither a version directory" in res.stderr


# ------------------------------------------------------------------------------------ a whole run


def test_the_local_example_with_lora_runs_to_its_end(tmp_path):
    """examples/local-lora.yaml (examples/local.yaml with trainer.lora): every version is an adapter of at
    most 5% of the model's bytes, the engine serves each one (the groups trained carry versions past 0),
    the run succeeds. Its groups are made smaller (4 answers of 8 tokens, 2 a step, where the example
    has 8 of 32 and 4): what is under test is the adapters' path, not what they learn."""
    import subprocess

    from tests.support.jobs import JobBuilder
    from tests.support.trainer_support import ASYNCRL, read_jsonl

    doc = JobBuilder.example("local-lora", **{"trainer.checkpointInterval": 2, "algorithm.groupSize": 4,
                                              "algorithm.batchSize": 2, "algorithm.maxNewTokens": 8}).doc()
    assert doc["spec"]["trainer"]["lora"]["rank"] == 16
    doc["spec"].pop("logging", None)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
    res = subprocess.run(ASYNCRL + ["run", str(job), "--max-steps", "4", "--run-dir", str(run), "--no-progress",
                                    "--no-evaluation"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "Succeeded (MaxStepsReached) at step 4" in res.stdout

    full_bytes = sum(f.stat().st_size for f in Path(resolve_model_path(MODEL)).glob("*.safetensors"))
    versions = sorted((run / "weights").glob("v*"))
    assert versions and all(sorted(p.name for p in v.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
                            for v in versions)
    assert all(sum(p.stat().st_size for p in v.iterdir()) <= 0.05 * full_bytes for v in versions)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["policy_version"] for m in metrics] == [1, 2, 3, 4] and all(m["tokens"] > 0 for m in metrics)
    assert all(m["staleness_max"] <= 2 for m in metrics)
    engine_log = (run / "logs" / "engine-0.log").read_text()
    for version in (1, 2, 3):
        assert f"loaded {(run / 'weights' / f'v{version}').resolve()}: " in engine_log, engine_log[-2000:]
    # (with eta 2 the first steps train groups of v0; by step 4 answers of a published adapter)
    trained_labels = [label for line in read_jsonl(run / "checkpoints" / "trained-groups.jsonl")
                      for label in line["labels"]]
    assert any(int(label.split("@")[0]) > 0 for label in trained_labels), \
        f"groups generated by a published adapter were trained: {trained_labels}"
    state = json.loads((run / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["identity"]["lora"]["rank"] == 16
    stored = sum(f.stat().st_size for f in (run / "checkpoints" / "step-000004").rglob("*") if f.is_file())
    assert stored < 0.5 * full_bytes, "a checkpoint is the adapter and its optimizer state"
