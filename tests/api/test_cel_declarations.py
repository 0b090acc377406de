"""Each CEL rule of the CRD is declared on the model it guards (`__cel_rules__`), and lands at that
model's schema node wherever the model is used; no rule is kept in a list apart from the models."""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing
from collections.abc import Iterator
from typing import Any, get_args, get_origin

from pydantic import BaseModel

import asyncrl.api.spec
from asyncrl.api import spec as S
from asyncrl.api.crd import build_crd, declared_cel_rules, immutable_rules
from asyncrl.api.spec.base import CelRule, SpecModel

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def spec_modules() -> list[types.ModuleType]:
    return [asyncrl.api.spec, *(importlib.import_module(f"asyncrl.api.spec.{m.name}")
                                for m in pkgutil.iter_modules(asyncrl.api.spec.__path__))]


def held(annotation: Any, suffix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(path suffix, model) of the models a field of this type holds (written apart from crd.py's walk)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield suffix, annotation
    elif get_origin(annotation) is list:
        yield from held(get_args(annotation)[0], suffix + "[]")
    elif get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            yield from held(arg, suffix)


def node_at(node: dict, dotted: str) -> dict:
    for part in dotted.split(".") if dotted else []:
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def model_nodes(model: type[BaseModel], node: dict, path: str = "") -> Iterator[tuple[type[BaseModel], dict, str]]:
    """Every place a model is used in the CRD's schema: (model, its schema node, its path)."""
    yield model, node, path
    for name, field in model.model_fields.items():
        wire = field.alias or name
        for suffix, inner in held(field.annotation):
            sub = f"{path}.{wire}{suffix}" if path else f"{wire}{suffix}"
            yield from model_nodes(inner, node_at(node, wire + suffix), sub)


def attached(node: dict) -> list[tuple[str, str]]:
    return [(v["rule"], v["message"]) for v in node.get("x-kubernetes-validations", [])]


def test_each_models_rules_land_at_its_node_in_order_wherever_it_is_used():
    places = 0
    for model, node, path in model_nodes(S.AsyncRLJob, SCHEMA):
        rules: tuple[CelRule, ...] = getattr(model, "__cel_rules__", ())
        for at in {r.at for r in rules}:
            mine = [(r.rule, r.message) for r in rules if r.at == at]
            there = attached(node_at(node, at))
            assert [x for x in there if x in mine] == mine, f"{model.__name__} at {path}.{at}"
            places += 1
    assert places >= 20, "the walk must reach the models that declare rules"


def test_a_model_used_in_several_places_has_its_rules_at_each():
    reward_rule = (S.RewardSpec.__cel_rules__[0].rule, S.RewardSpec.__cel_rules__[0].message)
    paths = [p for model, node, p in model_nodes(S.AsyncRLJob, SCHEMA) if model is S.RewardSpec]
    assert sorted(paths) == ["spec.datasets[].reward", "spec.evaluation.datasets[].reward",
                             "spec.evaluation.reward", "spec.reward"]
    assert all(reward_rule in attached(node_at(SCHEMA, p)) for p in paths)


def test_every_rule_in_the_crd_is_declared_on_a_model_or_is_an_immutability_rule():
    declared = {(r.rule, r.message) for model in _all_models() for r in model.__cel_rules__}
    immutable = {(rule, message) for _, rule, message in immutable_rules(SCHEMA)}
    in_crd = [rm for _, node, _ in _schema_nodes(SCHEMA) for rm in attached(node)]
    assert set(in_crd) <= declared | immutable
    assert len(in_crd) == len(declared_cel_rules()) + len(immutable)


def test_no_rule_list_apart_from_the_models():
    assert not hasattr(S, "CEL_RULES")
    for module in spec_modules():
        for name, value in vars(module).items():
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, CelRule) for v in value):
                raise AssertionError(f"{module.__name__}.{name} keeps CEL rules apart from the models")
            if isinstance(value, (list, tuple)) and value and all(
                    isinstance(v, tuple) and len(v) == 3 and all(isinstance(x, str) for x in v) for v in value):
                raise AssertionError(f"{module.__name__}.{name} looks like a (path, rule, message) list")


def _all_models() -> set[type[SpecModel]]:
    return {m for m, _, _ in model_nodes(S.AsyncRLJob, SCHEMA) if issubclass(m, SpecModel)}


def _schema_nodes(node: dict, path: str = "") -> Iterator[tuple[str, dict, str]]:
    yield path, node, path
    for name, prop in (node.get("properties") or {}).items():
        yield from _schema_nodes(prop, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")
