"""The CRD is generated from the models, checked in, structural, and accepted by Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import yaml

from asyncrl.api.crd import build_crd, declared_cel_rules, immutable_rules, render_crd_yaml
from asyncrl.api.reference import render_reference
from asyncrl.api.spec import IMMUTABLE_FIELDS
from tests.support.paths import REPO


def test_checked_in_crd_is_up_to_date():
    assert (REPO / "crds/asyncrljob.yaml").read_text() == render_crd_yaml(), \
        "run: asyncrl crd -o crds/asyncrljob.yaml"


def test_spec_reference_doc_is_up_to_date():
    assert (REPO / "docs/spec-reference.md").read_text() == render_reference(), \
        "run: asyncrl docs -o docs/spec-reference.md"


def test_kubernetes_validate_accepts_the_crd():
    for version in ("1.29", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(build_crd(), version, strict=True)


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_schema_is_structural():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith(".properties"):
            continue
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "properties" in node:
            assert node.get("type") == "object", path
            assert "additionalProperties" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_every_rule_and_immutable_field_is_attached():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [v["rule"] for _, node in _walk(schema) if isinstance(node, dict)
             for v in node.get("x-kubernetes-validations", [])]
    assert all(rule in rules for _, rule, _ in declared_cel_rules())
    immutable = immutable_rules(schema)
    assert len(immutable) == len(IMMUTABLE_FIELDS) and all(rule in rules for _, rule, _ in immutable)


def test_printer_columns_and_subresources():
    version = build_crd()["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Phase", "Step", "Version", "Staleness", "Rollout", "Reward", "Eval", "Age", "Reason"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.rollout.replicas"
    assert "status" in version["subresources"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"phase", "conditions", "trainer", "rollout", "staleness", "progress", "statusURL"} <= set(status)


def test_crd_yaml_parses_to_the_same_object():
    assert yaml.safe_load((REPO / "crds/asyncrljob.yaml").read_text()) == build_crd()
