"""Generate the AsyncRLJob CustomResourceDefinition from the pydantic models (pure: models in, dict out).

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema: no $ref,
no anyOf-with-null, boolean exclusiveMinimum, every object typed. This module does that translation
and adds what JSON Schema cannot say: CEL validations (the rules each model declares in
`__cel_rules__`), immutability, subresources, printer columns.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from asyncrl.api import spec as S
from asyncrl.api.spec.base import SpecModel

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.trainer.step"},
    {"name": "Version", "type": "integer", "jsonPath": ".status.trainer.policyVersion"},
    {"name": "Staleness", "type": "number", "jsonPath": ".status.staleness.mean",
     "description": "Mean policy-version lag of the tokens in the last step"},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.summary",
     "description": "Ready/desired rollout replicas"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
    {"name": "Eval", "type": "string", "jsonPath": ".status.evaluation.summary",
     "description": "held-out pass@1 and the policy version it was measured on"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1,
     "description": "Why the job is in its phase (a stall's cause while Running); shown by -o wide"},
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and turn pydantic's JSON Schema into a structural OpenAPI v3.0 schema."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        target.update({k: v for k, v in node.items() if k != "$ref"})
        return _resolve(target, defs)
    node = _without_null_union(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_structural_keyword(key, value, defs))
    if "properties" in out:
        out.setdefault("type", "object")
        _default_nested_objects(out)
    return out


def _without_null_union(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`anyOf`/`oneOf` of one type and null becomes that type, `nullable`; other unions cannot be
    said structurally."""
    node = dict(node)
    for key in ("anyOf", "oneOf"):
        if key not in node:
            continue
        options = [o for o in node[key] if o != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally: {node}")
        merged = {**_resolve(options[0], defs), **{k: v for k, v in node.items() if k != key}}
        if len(options) < len(node[key]):
            merged["nullable"] = True
        node = merged
    return node


def _structural_keyword(key: str, value: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON Schema keyword as OpenAPI v3.0 says it (possibly nothing, or two keywords)."""
    if key in ("title", "$defs") or (key == "default" and value is None):
        return {}
    if key == "additionalProperties" and isinstance(value, bool):
        return {}  # structural schemas forbid it beside `properties`; the API server prunes unknowns
    if key == "const":
        return {"enum": [value]}
    if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
        return {"minimum" if key == "exclusiveMinimum" else "maximum": value, key: True}
    if key == "properties":
        return {key: {name: _resolve(prop, defs) for name, prop in value.items()}}
    return {key: _resolve(value, defs)}


def _default_nested_objects(schema: dict[str, Any]) -> None:
    """Default nested objects so that CEL rules see fully defaulted objects, exactly as pydantic does.

    The default is the object with its inner defaults filled in, not {}: the API server checks each
    default against its property's CEL rules as written, without defaulting inside it first, so a
    rule reading self.batchSize rejects `default: {}` (and with it the whole CRD). At run time the
    two are the same: the server fills inner defaults into a defaulted {} anyway.
    Objects with required fields of their own (e.g. redis.external) stay absent instead, and so do
    optional (nullable) ones: absent is not empty there (a podTemplate or an env valueFrom
    defaulted to {} would change the spec's hash or break exactly-one-of rules)."""
    required = set(schema.get("required", []))
    for name, prop in schema["properties"].items():
        if (name not in required and prop.get("type") == "object" and "properties" in prop
                and not prop.get("required") and not prop.get("nullable")):
            prop.setdefault("default", structural_default({}, prop))


def structural_default(obj: Any, schema: dict[str, Any]) -> Any:
    """`obj` with every absent property that has a default filled in, recursively: what the API
    server's structural defaulting makes of it before validation and CEL."""
    if not isinstance(obj, dict) or "properties" not in schema:
        return obj
    out = dict(obj)
    for name, prop in schema["properties"].items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = structural_default(out[name], prop)
    return out


def _at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    """The schema node at `dotted` (`name[]`: the items of the list `name`)."""
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


def _held_models(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The models a field of this type holds, each with its path suffix: "" for the model itself
    (optional or not), "[]" for a list's items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return [held for arg in args for held in _held_models(arg)]
    if origin is list:
        return [("[]" + suffix, model) for suffix, model in _held_models(args[0])]
    if any(_held_models(arg) for arg in args):
        raise TypeError(f"{annotation}: a model held this way has no path for its CEL rules")
    return []


def declared_cel_rules(model: type[BaseModel] = S.AsyncRLJob, path: str = "") -> list[tuple[str, str, str]]:
    """Every CEL rule the models declare, as (json path, rule, message), found by walking the model
    tree down from `model` (at `path`): a model used in several places (a reward, a dataset) has its
    rules at each. Each node's rules keep the order their model declares them in."""
    own = model.__cel_rules__ if issubclass(model, SpecModel) else ()
    out = [(_joined(path, r.at), r.rule, r.message) for r in own]
    for name, field in model.model_fields.items():
        for suffix, held in _held_models(field.annotation):
            out += declared_cel_rules(held, _joined(path, (field.alias or name) + suffix))
    return out


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema for AsyncRLJob, with CEL rules and immutability attached."""
    raw = S.AsyncRLJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _resolve(raw, defs)
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"type": "string"}
    schema["properties"]["kind"] = {"type": "string"}
    schema["properties"]["status"].pop("nullable", None)
    schema["properties"]["status"].pop("default", None)
    for path, rule, message in declared_cel_rules():
        _at(schema, path).setdefault("x-kubernetes-validations", []).append({"rule": rule, "message": message})
    for path, rule, message in immutable_rules(schema):
        _at(schema, path).setdefault("x-kubernetes-validations", []).append({"rule": rule, "message": message})
    return schema


def immutable_rules(schema: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The transition rules of S.IMMUTABLE_FIELDS, (path, rule, message). A field that may be absent
    (no default) gets its rule on its parent, so adding or removing it is refused too: a rule on the
    field itself runs only when the old and the new object both have it."""
    out = []
    for path, message in S.IMMUTABLE_FIELDS:
        parent, _, name = path.rpartition(".")
        node = _at(schema, parent)
        optional = "default" not in node["properties"][name] and name not in node.get("required", [])
        if optional:
            out.append((parent, f"has(self.{name}) == has(oldSelf.{name}) && (!has(self.{name})"
                                f" || self.{name} == oldSelf.{name})", message))
        else:
            out.append((path, "self == oldSelf", message))
    return out


def build_crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{S.PLURAL}.{S.GROUP}"},
        "spec": {
            "group": S.GROUP,
            "scope": "Namespaced",
            "names": {"kind": S.KIND, "plural": S.PLURAL, "singular": S.SINGULAR,
                      "listKind": f"{S.KIND}List", "shortNames": S.SHORT_NAMES,
                      "categories": ["all", "asyncrl"]},
            "versions": [{
                "name": S.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.rollout.replicas",
                              "statusReplicasPath": ".status.rollout.ready",
                              "labelSelectorPath": ".status.rollout.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML text checked in at crds/asyncrljob.yaml."""
    header = "# Generated by `asyncrl crd` from the models in asyncrl/api/spec/. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
