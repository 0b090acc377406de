"""Reading job files: YAML documents in, validated AsyncRLJob models or located, readable errors out."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.api.spec import API_VERSION, KIND, AsyncRLJob
from asyncrl.infra.errors import SpecError


@dataclass(frozen=True)
class FieldError:
    """One problem in one document: where, what was there, and what is allowed."""

    source: str
    document: int
    path: str
    message: str
    value: Any = None
    line: int | None = None
    has_value: bool = False

    def __str__(self) -> str:
        where = self.source + (f":{self.line}" if self.line else "") + f" (document {self.document})"
        got = f" (got {self.value!r})" if self.has_value else ""
        return f"{where}: {self.path or '<document>'}: {self.message}{got}"


class JobFileError(SpecError):
    """A job file that cannot be used; `errors` lists every problem found."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


def _line_index(node: yaml.Node | None, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path in a composed YAML node tree to its 1-based line number."""
    out: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = prefix + (str(key.value),)
            out[path] = key.start_mark.line + 1
            out.update(_line_index(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = prefix + (str(i),)
            out[path] = item.start_mark.line + 1
            out.update(_line_index(item, path))
    return out


def _nearest_line(lines: dict[tuple[str, ...], int], path: tuple[str, ...]) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The wire names allowed in the object at `loc` (walking the models by alias)."""
    model: Any = AsyncRLJob
    for part in loc:
        fields = {(f.alias or n): f for n, f in getattr(model, "model_fields", {}).items()}
        if part not in fields:
            return []
        annotation = fields[part].annotation
        candidates = [annotation, *typing.get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return [(f.alias or n) for n, f in model.model_fields.items()]


def _describe(err: Mapping[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(tuple(err["loc"][:-1]))
        close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown field; {hint}allowed: {', '.join(allowed)}" if allowed else "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    return msg.removeprefix("Value error, ")


def parse_job(data: Any, *, source: str = "<input>", document: int = 1,
              lines: dict[tuple[str, ...], int] | None = None) -> AsyncRLJob:
    """Validate one decoded document as an AsyncRLJob, raising JobFileError with located errors."""
    lines = lines or {}

    def error(path: tuple[str, ...], message: str, value: Any = None, has_value: bool = False) -> FieldError:
        return FieldError(source, document, ".".join(path), message, value,
                          _nearest_line(lines, path), has_value)

    if data is None:
        raise JobFileError([error((), "empty document: expected an AsyncRLJob mapping")])
    if not isinstance(data, dict):
        raise JobFileError([error((), f"expected a mapping (an AsyncRLJob object), got {type(data).__name__}")])
    kind, api = data.get("kind"), data.get("apiVersion")
    if (kind is not None and kind != KIND) or (api is not None and api != API_VERSION):
        raise JobFileError([error(("kind",), f"this is a {kind or '?'} ({api or 'no apiVersion'}); "
                                  f"expected kind {KIND} with apiVersion {API_VERSION}")])
    try:
        return AsyncRLJob.model_validate(data)
    except ValidationError as exc:
        errors = []
        for e in exc.errors():
            path = tuple(str(p) for p in e["loc"])
            has_value = e["type"] != "missing" and not (path == () and isinstance(e.get("input"), dict))
            value = e.get("input") if has_value and not isinstance(e.get("input"), dict) else None
            errors.append(error(path, _describe(e), value, has_value and value is not None))
        raise JobFileError(errors) from None


def load_jobs_text(text: str, *, source: str = "<input>") -> list[AsyncRLJob]:
    """Parse every YAML document in `text`; collect the errors of all documents before raising."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise JobFileError([FieldError(source, 1, "", f"YAML syntax error: {problem}", line=line)]) from None
    if not docs:
        raise JobFileError([FieldError(source, 1, "", "empty file: expected an AsyncRLJob document")])
    jobs, errors = [], []
    for i, (doc, node) in enumerate(zip(docs, nodes), start=1):
        if doc is None and len(docs) > 1:
            continue  # a stray '---' between documents
        try:
            jobs.append(parse_job(doc, source=source, document=i, lines=_line_index(node)))
        except JobFileError as exc:
            errors.extend(exc.errors)
    if errors:
        raise JobFileError(errors)
    return jobs


def load_jobs(path: str | Path) -> list[AsyncRLJob]:
    """Read and validate every AsyncRLJob in a YAML file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobFileError([FieldError(str(p), 1, "", f"cannot read file: {exc}")]) from None
    return load_jobs_text(text, source=str(p))


def load_job(path: str | Path) -> AsyncRLJob:
    """Read a file that must hold exactly one AsyncRLJob (what `run`, `trainer`, `rollout` take)."""
    jobs = load_jobs(path)
    if len(jobs) != 1:
        raise JobFileError([FieldError(str(path), 1, "", f"expected exactly one AsyncRLJob, found {len(jobs)}")])
    return jobs[0]
