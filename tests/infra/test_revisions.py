"""model.revision and dataset.revision: a hub revision is what every component loads.

The model side goes through the real transformers/huggingface_hub resolution, offline, against a hub
cache laid out as the hub client lays it out (refs/<name> -> a commit, snapshots/<commit>/files): two
revisions of one repository that differ in their config. The engines get the same revision as a
flag their pinned releases declare (SGLang's server_args.py, vLLM's arg_utils.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.infra.hf_models import ModelNotFoundError, load_causal_lm, load_tokenizer, resolve_model_path, vocab_size
from asyncrl.operator.render import render
from tests.support.engine_routes import pin_file
from tests.support.jobs import JobBuilder
from tests.support.vllm_server import VLLM_PYTHON

REPO_ID = "asyncrl-test/smol"
COMMITS = {"main": "a" * 40, "v2": "b" * 40}
V2_POSITIONS = 4096


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding REPO_ID at `main` (the embedded model) and `v2` (the same weights, a
    config with another max_position_embeddings)."""
    source = Path(resolve_model_path("embedded:SmolLM2-135M-Instruct"))
    repo = tmp_path / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    for name, commit in COMMITS.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in source.iterdir():
            (snapshot / f.name).symlink_to(f)
    v2_config = repo / "snapshots" / COMMITS["v2"] / "config.json"
    config = json.loads(v2_config.read_text())
    config["max_position_embeddings"] = V2_POSITIONS
    v2_config.unlink()
    v2_config.write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return repo


def test_the_model_tokenizer_and_config_come_from_the_revision(hub: Path):
    default = load_causal_lm(REPO_ID)
    pinned = load_causal_lm(REPO_ID, revision="v2")
    assert default.config.max_position_embeddings == 8192
    assert pinned.config.max_position_embeddings == V2_POSITIONS
    by_commit = load_causal_lm(REPO_ID, revision=COMMITS["v2"])
    assert by_commit.config.max_position_embeddings == V2_POSITIONS
    assert vocab_size(REPO_ID, "v2") == 49152
    assert load_tokenizer(REPO_ID, revision="v2")("2 + 3").input_ids == load_tokenizer(REPO_ID)("2 + 3").input_ids
    with pytest.raises(ModelNotFoundError, match=REPO_ID):
        load_causal_lm(REPO_ID, revision="no-such-tag")


def _engine(engine: str, **model: str) -> list[str]:
    doc = JobBuilder.example(**{"rollout.engine": engine, "rollout.engineArgs": [],
                                "model.path": "Qwen/Qwen2.5-1.5B-Instruct",
                                **{f"model.{k}": v for k, v in model.items()}}).doc()
    docs = list(yaml.safe_load_all(render(parse_job(doc), uid="u", redis_password="p")))
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    (engine_container,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return engine_container["command"]


def _flags_in(source: Path) -> set[str]:
    """Every string literal that looks like a command-line flag in `source`."""
    tree = ast.parse(source.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("--")}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engines_get_the_revision_as_a_flag_of_their_pin(engine: str):
    command = _engine(engine, revision="0123abcd")
    at = command.index("--revision")
    assert command[at + 1] == "0123abcd"
    assert "--revision" not in _engine(engine)
    if engine == "sglang":  # every flag we render, not only --revision
        declared = _flags_in(pin_file("sglang/srt/server_args.py"))
        flags = {a for a in _engine(engine, revision="r", tokenizer="Qwen/Qwen2.5-1.5B-Instruct") if a.startswith("--")}
        assert flags <= declared, f"flags the pinned SGLang does not declare: {sorted(flags - declared)}"
    else:
        found = sorted(VLLM_PYTHON.parent.parent.glob("lib/python3*/site-packages/vllm/engine/arg_utils.py"))
        if not found:
            pytest.fail(f"vLLM is not installed in {VLLM_PYTHON.parent.parent}; run `bash scripts/install-vllm.sh`")
        declared = _flags_in(found[0])
    assert "--revision" in declared, f"the pinned {engine} has no --revision flag"


@pytest.mark.parametrize(("change", "path", "says"), [
    ({"model.revision": "v1"}, "spec.model", "needs a Hugging Face Hub id"),
    ({"model.path": "/models/qwen", "model.revision": "main"}, "spec.model", "a local directory"),
    ({"model.path": "Qwen/Qwen2.5-1.5B-Instruct", "model.revision": "bad rev"}, "spec.model.revision",
     "should match pattern"),
    ({"dataset.revision": "v1"}, "spec.dataset", "hf: sources only"),
])
def test_a_revision_where_the_source_has_none_is_refused_naming_the_field(change, path, says):
    with pytest.raises(JobFileError) as err:
        parse_job(JobBuilder.example("local").set(**change).doc())
    [(where, message)] = [(e.path, e.message) for e in err.value.errors]
    assert where == path and says in message


def test_a_hub_dataset_takes_a_revision():
    job = parse_job(JobBuilder.example("local").set(**{"dataset.source": "hf:openai/gsm8k:main",
                                                       "dataset.revision": "e53f048"}).doc())
    assert job.spec.dataset is not None and job.spec.dataset.revision == "e53f048"
