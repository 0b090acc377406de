"""The CRD as the API server would apply it: structural defaults, the openAPIV3Schema (jsonschema) and
every CEL rule (cel-python), on the examples and on objects that break one rule each."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from asyncrl.api.crd import build_crd, declared_cel_rules, immutable_rules, structural_default
from asyncrl.api.spec import (
    IMMUTABLE_FIELDS,
    LORA_SGLANG_MODULES_MESSAGE,
    LORA_TRANSPORT_MESSAGE,
    LORA_VLLM_RANK_MESSAGE,
)
from asyncrl.api.spec.lora import ALL_LINEAR_ALONE
from tests.support.paths import REPO

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CEL_RULES = declared_cel_rules()
"""(path, rule, message) of every CEL rule the models declare."""
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def defaulted(schema: dict, obj: Any) -> Any:
    """Structural defaulting, as the API server does before validation and CEL."""
    return structural_default(obj, schema)


def at(obj: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        obj = obj[key]
    return obj


def nodes(obj: Any, dotted: str) -> list[Any]:
    """Every value a rule at `dotted` is evaluated on (`name[]`: each item of the list `name`); none
    when the object is absent (the API server skips rules of absent ones)."""
    found = [obj]
    for key in dotted.split(".") if dotted else []:
        name = key.removesuffix("[]")
        values = [o[name] for o in found if isinstance(o, dict) and name in o]
        found = [item for v in values for item in v] if key.endswith("[]") else values
    return found


def present(obj: dict, dotted: str) -> bool:
    return bool(nodes(obj, dotted))


def schema_at(dotted: str) -> dict:
    node = SCHEMA
    for key in dotted.split("."):
        node = node["properties"][key]
    return node


def cel_rules(root: dict = SCHEMA) -> list[tuple[str, str, str]]:
    """Every (path, rule, message) attached to `root` and below, found by walking it (not from
    spec.py); the path is relative to `root` ("" for root's own rules)."""
    found: list[tuple[str, str, str]] = []

    def walk(node: dict, path: str) -> None:
        for v in node.get("x-kubernetes-validations", []):
            found.append((path, v["rule"], v["message"]))
        for name, prop in (node.get("properties") or {}).items():
            walk(prop, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(root, "")
    return found


ENV = celpy.Environment()


def evaluate(rule: str, new: Any, old: Any = None) -> bool:
    """The rule's verdict; a rule that cannot be evaluated (a missing key, a type error) fails, as
    it does in the API server (cel-python returns such errors as values, which would read as true)."""
    activation = {"self": celpy.json_to_cel(new)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    result = ENV.program(ENV.compile(rule)).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def violations(obj: dict, old: dict | None = None) -> list[str]:
    """Messages of the rules `obj` breaks (transition rules only when `old` is given)."""
    obj = defaulted(SCHEMA, obj)
    old = defaulted(SCHEMA, old) if old is not None else None
    out = []
    for path, rule, message in cel_rules():
        if "oldSelf" in rule and old is None:
            continue
        news = nodes(obj, path)
        olds = nodes(old, path) if old is not None and "oldSelf" in rule else [None] * len(news)
        if any(not evaluate(rule, n, o) for n, o in zip(news, olds, strict=True)):
            out.append(message)
    return out


def defaults_in_schema() -> list[tuple[str, dict]]:
    """(path, property schema) of every property that declares a `default`."""
    found: list[tuple[str, dict]] = []

    def walk(node: dict, path: str) -> None:
        if "default" in node:
            found.append((path, node))
        for name, prop in (node.get("properties") or {}).items():
            walk(prop, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(SCHEMA, "")
    return found


def default_errors(prop: dict) -> list[str]:
    """What the API server says of one property's `default` when the CRD is created: the default
    as written (nothing defaulted inside it) must pass the property's schema and every CEL rule of
    the property and of the properties below it that the default holds, evaluated once with
    oldSelf = the default (transition rules too) and once without an old object."""
    value = prop["default"]
    errors = [f"schema: {e.message}" for e in jsonschema.Draft4Validator(prop).iter_errors(value)]
    for path, rule, message in cel_rules(prop):
        for self_value in nodes(value, path):
            errors += _rule_errors(rule, message, path, self_value)
    return errors


def _rule_errors(rule: str, message: str, path: str, self_value: Any) -> list[str]:
    """One rule on one value, once with oldSelf = the value and once without an old object."""
    errors = []
    for old in (self_value, None):
        if "oldSelf" in rule and old is None:
            continue
        try:
            passed = evaluate(rule, self_value, old)
        except celpy.CELEvalError as e:
            errors.append(f"{path or '.'}: {e.args[0] if e.args else e} evaluating rule: {message}")
            continue
        if not passed:
            errors.append(f"{path or '.'}: {message}")
    return errors


def test_every_default_is_accepted_as_the_api_server_checks_it():
    """A default the API server refuses rejects the whole CRD, so `helm install` fails on every
    cluster: `default: {}` under a rule reading self.batchSize did exactly that."""
    checked = defaults_in_schema()
    assert any(p == "spec.algorithm" for p, _ in checked), "the walk must reach the algorithm default"
    failures = {path: errors for path, prop in checked if (errors := default_errors(prop))}
    assert failures == {}


def test_default_errors_sees_a_default_that_misses_a_key_a_rule_reads():
    algorithm = copy.deepcopy(schema_at("spec.algorithm"))
    algorithm["default"] = {}
    errors = default_errors(algorithm)
    assert any("batchSize must be divisible by minibatches" in e for e in errors), errors
    assert default_errors(schema_at("spec.algorithm")) == []


# An optional object with required fields of its own (spec.redis.external) must not get a
# default: the API server would default it into every job and reject the job.


def test_optional_objects_with_required_fields_have_no_default():
    with_required = []

    def walk(node: dict, path: str) -> None:
        for name, prop in (node.get("properties") or {}).items():
            if prop.get("required") and "default" in prop:
                with_required.append(f"{path}.{name}")
            walk(prop, f"{path}.{name}")

    walk(SCHEMA, "")
    assert with_required == []


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "examples" / name).read_text())


def test_rules_in_crd_are_the_spec_rules():
    declared = set(CEL_RULES) | set(immutable_rules(SCHEMA))
    assert set(cel_rules()) == declared


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_schema_and_cel(path):
    obj = load(path.name)
    jsonschema.Draft4Validator(SCHEMA).validate(defaulted(SCHEMA, obj))
    assert violations(obj) == []
    assert violations(obj, old=obj) == [], "an unchanged object passes the transition rules"


COLLECTIVE_MESSAGE = ("trainer.weightTransport 'collective' needs rollout.engine sglang or hf ("
                      "vLLM 0.32's own weight transfer is another protocol, not spoken yet); allowed with vllm: disk")

TB_UNUSED_MESSAGE = next(m for _, _, m in CEL_RULES if m.startswith("objective 'tb' has no ratio"))

BREAKERS = {
    "a reward is scored by one of service and judge, not both":
        {"reward": {"service": {"url": "http://rewards:8100"}, "judge": {"url": "http://judge/v1", "model": "m"}}},
    "set evaluation.dataset (one source) or evaluation.datasets, not both":
        {"evaluation": {"dataset": {"source": "builtin:arithmetic"}, "datasets": [{"name": "a"}]}},
    "each source of evaluation.datasets needs a name of its own":
        {"evaluation": {"dataset": None, "datasets": [{"name": "a"}, {"name": "a"}]}},
    "an evaluation source's reward.service takes a url only (the operator runs the job's "
    "reward.service.deployment)":
        {"evaluation": {"dataset": None, "datasets": [{"name": "a", "reward": {"service": {"deployment": {}}}}]}},
    "set dataset (one source) or datasets (a mixture), not both":
        {"dataset": {"source": "builtin:arithmetic"}, "datasets": [{"name": "a", "weight": 1}]},
    "each source of datasets needs a name of its own":
        {"dataset": None, "datasets": [{"name": "a", "weight": 1}, {"name": "a", "weight": 2}]},
    "a source's reward.service takes a url only (the operator runs the job's reward.service.deployment, which "
    "sources use when they have no reward of their own)":
        {"dataset": None, "datasets": [{"name": "a", "weight": 1, "reward": {"service": {"deployment": {}}}}]},
    "evaluation.reward.service takes a url only (the operator runs the job's reward.service.deployment, which "
    "evaluation uses when it has no reward of its own)":
        {"evaluation": {"reward": {"service": {"deployment": {}}}}},
    "reward.service needs exactly one of url (an existing service) and deployment (one the operator runs with "
    "the job)": {"reward": {"service": {"url": "http://rewards:8100", "deployment": {}}}},
    "proximal 'loglinear' requires loss 'decoupled'": {"algorithm": {"loss": "ppo", "proximal": "loglinear"}},
    "batchSize must be divisible by minibatches": {"algorithm": {"batchSize": 30, "minibatches": 4}},
    "advantageEstimator grpo and rloo need groupSize >= 2":
        {"algorithm": {"advantageEstimator": "rloo", "groupSize": 1}},
    "clipEpsHigh must be >= clipEps (unless objective is cispo)": {"algorithm": {"clipEps": 0.3, "clipEpsHigh": 0.2}},
    "m2 requires objective 'ppo-clip'": {"algorithm": {"objective": "gspo", "m2": {"threshold": 0.04}}},
    "dualClip requires objective 'ppo-clip'": {"algorithm": {"objective": "cispo", "dualClip": 3.0}},
    "objective 'sapo' has no clip: leave clipEps and clipEpsHigh at their defaults":
        {"algorithm": {"objective": "sapo", "clipEpsHigh": 0.28}},
    "sapo only applies to objective 'sapo'": {"algorithm": {"sapo": {"tauNeg": 2.0}}},
    "loglinearOnPolicy 'current' requires minibatches 1 (use 'behave')":
        {"algorithm": {"loglinearOnPolicy": "current", "minibatches": 2}},
    "topP must be 1.0: the trainer scores the full distribution": {"algorithm": {"topP": 0.9}},
    "topK must be -1: the trainer scores the full distribution": {"algorithm": {"topK": 50}},
    "dynamicSampling needs groupSize >= 2":
        {"algorithm": {"dynamicSampling": {}, "advantageEstimator": "dr_grpo", "groupSize": 1}},
    "dynamicSampling.maxDraws must be >= batchSize": {"algorithm": {"dynamicSampling": {"maxDraws": 31}}},
    "mode 'external' requires external.urlSecret": {"redis": {"mode": "external"}},
    "trainer.weightSyncLag must be <= the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))":
        {"trainer": {"weightSyncLag": 99}},
    COLLECTIVE_MESSAGE: {"rollout": {"engine": "vllm"}, "trainer": {"weightTransport": "collective"}},
    LORA_VLLM_RANK_MESSAGE: {"rollout": {"engine": "vllm"}, "trainer": {"lora": {"rank": 1024}}},
    LORA_SGLANG_MODULES_MESSAGE: {"rollout": {"engine": "sglang"}, "trainer": {"lora": {"targetModules": ["c_attn"]}}},
    LORA_TRANSPORT_MESSAGE: {"rollout": {"engine": "hf"}, "trainer": {"lora": {}, "weightTransport": "collective"}},
    ALL_LINEAR_ALONE: {"rollout": {"engine": "hf"}, "trainer": {"lora": {"targetModules": ["all-linear", "q_proj"]}}},
    "policy 'per-sample' requires asyncRatio": {"staleness": {"policy": "per-sample"}},
    "asyncRatio requires policy 'per-sample'": {"staleness": {"asyncRatio": 0.5}},
    "maxHeadOffpolicyness applies to policy 'global-budget' only (per-sample: asyncRatio)":
        {"staleness": {"policy": "per-sample", "asyncRatio": 0.5, "maxHeadOffpolicyness": 2}},
    "evaluation.samplesPerPrompt > 1 needs temperature > 0 (greedy answers are identical)":
        {"evaluation": {"samplesPerPrompt": 4}},
    "bapo requires objective 'ppo-clip', no m2, and clipEps/clipEpsHigh at their defaults":
        {"algorithm": {"bapo": {}, "clipEpsHigh": 0.28}},
    "each bapo.clip*Start must be <= its bapo.clip*Max":
        {"algorithm": {"bapo": {"clipLowStart": 0.85}, "clipEpsHigh": None}},
    "vcpo.essScaling requires loss 'decoupled'":
        {"algorithm": {"vcpo": {"essScaling": True}, "loss": "ppo", "proximal": "recompute"}},
    "vcpo.baseEssRatio and vcpo.scaling only apply with vcpo.essScaling true":
        {"algorithm": {"vcpo": {"scaling": "linear"}}},
    "vcpo.baseline needs aggregation 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'":
        {"algorithm": {"vcpo": {"baseline": True}}, "trainer": {"gpusPerReplica": 1}},
    "vcpo.baseline needs advantageEstimator 'grpo'":
        {"algorithm": {"vcpo": {"baseline": True}, "aggregation": "seq-mean-token-mean", "advantageEstimator": "rloo"},
         "trainer": {"gpusPerReplica": 1}},
    "vcpo.baseline needs batchNormalizeAdvantages false":
        {"algorithm": {"vcpo": {"baseline": True}, "aggregation": "seq-mean-token-mean",
                       "batchNormalizeAdvantages": True},
         "trainer": {"gpusPerReplica": 1}},
    "algorithm.vcpo.baseline needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)":
        {"algorithm": {"vcpo": {"baseline": True}, "aggregation": "seq-mean-token-mean"}},
    TB_UNUSED_MESSAGE: {"algorithm": {"objective": "tb", "behaviourCap": {"limit": 3.0}, "clipEpsHigh": None},
                        "trainer": {"gpusPerReplica": 1}},
    "tb and replay only apply to objective 'tb'": {"algorithm": {"replay": {}}},
    "replay needs batchSize >= 2 (every step keeps one slot for a fresh group)":
        {"algorithm": {"objective": "tb", "clipEpsHigh": None, "replay": {}, "batchSize": 1, "minibatches": 1},
         "trainer": {"gpusPerReplica": 1}},
    "objective 'tb' needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)":
        {"algorithm": {"objective": "tb", "clipEpsHigh": None}},
    "dataset.messagesField replaces promptField: set one of them":
        {"dataset": {"source": "/data/chats.parquet", "promptField": "text", "messagesField": "chat"}},
    "builtin datasets have no columns to map (promptField, answerField, messagesField, metadataFields)":
        {"dataset": {"source": "builtin:arithmetic", "metadataFields": ["level"]}},
    "dataset.revision applies to hf: sources only (a file or a builtin has no revisions)":
        {"dataset": {"source": "/data/train.jsonl", "revision": "v1"}},
    "model.revision needs a Hugging Face Hub id in model.path (a local directory or an embedded: model has no "
    "revisions)": {"model": {"path": "/models/qwen", "revision": "main"}},
}


def merged(base: dict, change: dict) -> dict:
    """`base` with `change` merged in; a None value removes the field."""
    out = copy.deepcopy(base)
    for k, v in change.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@pytest.mark.parametrize("message", sorted(BREAKERS))
def test_each_rule_is_violated_by_some_object(message):
    job = load("job.yaml")
    bad = copy.deepcopy(job)
    bad["spec"] = merged(job["spec"], BREAKERS[message])
    assert violations(bad) == [message]


def test_examples_pass_every_cel_rule():
    """CEL alone, without schema defaulting."""
    for path in EXAMPLES:
        obj = load(path.name)
        assert violations(obj) == [], path.name
        assert violations(obj, old=obj) == [], path.name


def test_every_rule_has_a_breaker():
    assert set(BREAKERS) == {m for _, m, in [(r, m) for _, r, m in CEL_RULES]}


@pytest.mark.parametrize("path, value, message", [
    ("spec.model.path", "Qwen/Qwen2.5-7B-Instruct", "model is immutable: create a new job to train another model"),
    ("spec.rollout.engine", "vllm", "rollout.engine is immutable"),
    ("spec.algorithm.batchSize", 64, "algorithm.batchSize is immutable (admission counts in batches)"),
    ("spec.algorithm.groupSize", 8, "algorithm.groupSize is immutable"),
    ("spec.storage.size", "1Ti", "storage is immutable: weights and checkpoints live there"),
])
def test_updates_of_immutable_fields_are_rejected(path, value, message):
    old = load("job.yaml")
    new = copy.deepcopy(old)
    node = new
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    assert message in violations(new, old=old)


LORA_IMMUTABLE = dict(IMMUTABLE_FIELDS)["spec.trainer.lora"]


@pytest.mark.parametrize("old_lora, new_lora", [(None, {}), ({}, None), ({"rank": 8}, {"rank": 16})])
def test_lora_cannot_be_added_removed_or_changed(old_lora, new_lora):
    old = merged(load("job.yaml"), {"spec": {"rollout": {"engine": "hf"}}})
    new = copy.deepcopy(old)
    for obj, lora in ((old, old_lora), (new, new_lora)):
        if lora is not None:
            obj["spec"]["trainer"]["lora"] = lora
    assert LORA_IMMUTABLE in violations(new, old=old)
    assert LORA_IMMUTABLE not in violations(new, old=new)


def test_mutable_update_is_accepted():
    old = load("job.yaml")
    new = merged(old, {"spec": {"rollout": {"replicas": 8}, "suspend": True}})
    assert violations(new, old=old) == []


def test_schema_rejects_bad_types():
    bad = merged(load("job.yaml"), {"spec": {"rollout": {"replicas": -1}}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(SCHEMA).validate(defaulted(SCHEMA, bad))


LAG_MESSAGE = "trainer.weightSyncLag must be <= the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))"


@pytest.mark.parametrize("staleness, lag, ok", [
    ({"maxHeadOffpolicyness": 2}, 2, True),
    ({"maxHeadOffpolicyness": 2}, 3, False),
    ({}, 4, True),
    ({}, 5, False),
    ({"policy": "per-sample", "asyncRatio": 1.5}, 2, True),
    ({"policy": "per-sample", "asyncRatio": 1.5}, 3, False),
    ({"policy": "per-sample", "asyncRatio": 2.0}, 2, True),
    ({"policy": "per-sample", "asyncRatio": 0.0}, 1, False),
])
def test_weight_sync_lag_rule_agrees_with_the_spec(staleness, lag, ok):
    """The CEL rule and the pydantic validator (ceil(asyncRatio) written without ceil) agree."""
    from pydantic import ValidationError

    from asyncrl.api.spec import AsyncRLJob

    job = load("job.yaml")
    job["spec"]["staleness"] = staleness
    job["spec"]["trainer"] = {**job["spec"].get("trainer", {}), "weightSyncLag": lag}
    assert (LAG_MESSAGE not in violations(job)) == ok
    try:
        AsyncRLJob.model_validate(job)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == ok


@pytest.mark.parametrize("engine", [None, "sglang", "hf", "vllm"])
@pytest.mark.parametrize("transport", [None, "disk", "collective"])
def test_weight_transport_rule_agrees_with_the_spec(engine, transport):
    """collective needs an engine that can join a process group (sglang, the default, or hf); the CEL
    rule and the pydantic validator agree on every engine x transport, unset fields included."""
    from pydantic import ValidationError

    from asyncrl.api.spec import AsyncRLJob

    job = load("job.yaml")
    if engine is None:
        job["spec"]["rollout"].pop("engine", None)
    else:
        job["spec"]["rollout"]["engine"] = engine
    if transport is not None:
        job["spec"]["trainer"]["weightTransport"] = transport
    ok = not (transport == "collective" and engine == "vllm")
    assert (COLLECTIVE_MESSAGE not in violations(job)) == ok
    # CEL without the schema's defaults, as for an object whose fields are absent
    raw = [m for path, rule, m in cel_rules() if m == COLLECTIVE_MESSAGE and not evaluate(rule, at(job, path))]
    assert (raw == []) == ok
    try:
        AsyncRLJob.model_validate(job)
        accepted = True
    except ValidationError as err:
        accepted = False
        assert "trainer.weightTransport 'collective' needs rollout.engine sglang or hf" in str(err)
        assert "allowed with vllm: disk" in str(err)
    assert accepted == ok
