"""Where a figure of the trainer's report goes, declared on the field that holds it.

A new figure is one field of the report's models (asyncrl/api/status_report.py) with its docstring:
/status and metrics.jsonl carry it because they dump the models, and this module tells the
Prometheus exporter (trainer/report/prometheus.py), the dashboard (its "last step" card) and the operator's
mirror what the field is, so none of them names it. A field's `Annotated` metadata may hold one
`Exported` saying how it is scraped; a model whose `EXPORT_EVERY_NUMBER` is true (the step's
record) exports each number field as a gauge named after it unless its metadata says otherwise.
A table (a `dict[str, number]` field, e.g. a figure per mixture source) is exported with
`per_key`: one series per key, the key in the label `key_label`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

MetricKind = Literal["gauge", "counter"]


@dataclass(frozen=True)
class Exported:
    """How one field is scraped: `asyncrl_trainer_<name>{labels}` of `kind` (`name` None: it is not,
    and `reason` says why). Fields sharing a name form one family, told apart by their labels."""

    name: str | None
    kind: MetricKind = "gauge"
    labels: tuple[tuple[str, str], ...] = ()
    help: str = ""
    """The family's help text; the first field's docstring when empty."""
    reason: str = ""
    key_label: str | None = None
    """A table's: the label its keys go in (one series per key)."""


def gauge(name: str, help: str = "", **labels: str) -> Exported:
    """A gauge (the figure's current value)."""
    return Exported(name, "gauge", tuple(labels.items()), help)


def counter(name: str, help: str = "", **labels: str) -> Exported:
    """A counter (a running total; Prometheus adds `_total`)."""
    return Exported(name, "counter", tuple(labels.items()), help)


def per_key(name: str, key_label: str, help: str = "", kind: MetricKind = "gauge") -> Exported:
    """A table (`dict[str, number]`): one series of `kind` per key, the key in label `key_label`."""
    return Exported(name, kind, (), help, key_label=key_label)


def not_exported(reason: str) -> Exported:
    """Not a Prometheus figure, for `reason` (an axis, a table exported another way)."""
    return Exported(None, reason=reason)


@dataclass(frozen=True)
class Figure:
    """One field of a report, where it sits (`path` from the root model) and how it is exported."""

    path: tuple[str, ...]
    field: FieldInfo
    exported: Exported | None
    value: Any

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def description(self) -> str:
        return " ".join((self.field.description or "").split())


def figures(model: BaseModel | type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[Figure]:
    """Every scalar field of `model` and of the models nested in it, depth first in declaration
    order. Given a class (or where a nested model is None) the values are the defaults (None for a
    required field): the figures exist, with no value yet."""
    cls = model if isinstance(model, type) else type(model)
    every_number = bool(getattr(cls, "EXPORT_EVERY_NUMBER", False))
    for key, info in cls.model_fields.items():
        value = None if isinstance(model, type) else getattr(model, key)
        if isinstance(model, type) and not info.is_required():
            value = info.get_default(call_default_factory=True)
        nested = nested_model(info.annotation)
        if nested is not None:
            yield from figures(value if isinstance(value, BaseModel) else nested, (*prefix, key))
            continue
        marks = [m for m in info.metadata if isinstance(m, Exported)]
        exported = marks[0] if marks else (gauge(key) if every_number and is_number(info.annotation) else None)
        yield Figure((*prefix, key), info, exported, value)


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (`Model` or `Model | None`), or None for anything else."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    return models[0] if len(models) == 1 else None


def is_number(annotation: Any) -> bool:
    """int or float (or one of them | None), and not bool."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    kinds = [c for c in candidates if c is not type(None)]
    return bool(kinds) and all(c in (int, float) for c in kinds)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
