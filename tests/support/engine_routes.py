"""The route tables of the pinned engines, read from their own source.

SGLang 0.5.10.post1: the wheel's `http_server.py` and the routers it includes, cached by
scripts/fetch-sglang-source.sh into .tools/sglang-<PINNED_VERSION>/ (tests/rollout/engines/test_sglang_routes.py
checks our calls and the fake against it). vLLM 0.32: every route declared anywhere under the
installed wheel's `vllm/entrypoints/` (.venv-vllm), a superset of what one server serves, which is
what a test of "every route is closed" wants.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.rollout.engines.sglang import PINNED_VERSION
from tests.support.paths import REPO
from tests.support.vllm_server import VLLM_PYTHON

PIN_DIR = REPO / ".tools" / f"sglang-{PINNED_VERSION}"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
FETCH_HINT = "run `bash scripts/fetch-sglang-source.sh` (scripts/setup.sh --tests does)"
ROUTE_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options", "api_route"}


def pin_file(rel: str) -> Path:
    path = PIN_DIR / rel
    if not path.is_file():
        pytest.fail(f"the pinned SGLang {PINNED_VERSION} source is missing: {path} does not exist; {FETCH_HINT}",
                    pytrace=False)
    return path


# ---------------------------------------------------------------- reading the pinned source


@dataclass
class Route:
    methods: set[str] = field(default_factory=set)
    handlers: list[ast.AsyncFunctionDef | ast.FunctionDef] = field(default_factory=list)
    body_models: set[str] = field(default_factory=set)


def _module_strings(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `NAME = <expr>` assignments (route paths may be named)."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
    return out


def _path_value(node: ast.expr, names: dict[str, ast.expr]) -> str | None:
    """A route path: a literal, or `os.environ.get("VAR", "/default")` (its default); None if dynamic."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return _path_value(names[node.id], {})
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv"):
        if len(node.args) >= 2:
            return _path_value(node.args[1], names)
        return None
    return None


def _methods(call: ast.Call) -> set[str]:
    assert isinstance(call.func, ast.Attribute)
    if call.func.attr not in ("api_route", "add_api_route"):
        return {call.func.attr.upper()}
    for kw in call.keywords:
        if kw.arg == "methods":
            return {m.upper() for m in ast.literal_eval(kw.value)}
    return {"GET"}  # FastAPI's default for api_route / add_api_route


def _routes_of(source: Path, owner: str | None, table: dict[str, Route]) -> list[tuple[str, str]]:
    """Add the routes declared on `owner` (app or router; None: any name) in `source`; return included routers."""
    tree = ast.parse(source.read_text(), filename=str(source))
    names = _module_strings(tree)
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):  # walk, not body: routes declared under `if` count too
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and isinstance(dec.func.value, ast.Name) and owner in (None, dec.func.value.id)
                        and dec.func.attr in ROUTE_DECORATORS and (dec.args or dec.keywords)):
                    arg = dec.args[0] if dec.args else next(k.value for k in dec.keywords if k.arg == "path")
                    path = _path_value(arg, names)
                    if path is None:
                        continue  # only routed when an environment variable names it
                    route = table.setdefault(path, Route())
                    route.methods |= _methods(dec)
                    route.handlers.append(node)
                    for a in node.args.args:
                        if a.annotation is not None and isinstance(a.annotation, ast.Name) and a.arg == "obj":
                            route.body_models.add(a.annotation.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_api_route"
                and isinstance(node.func.value, ast.Name) and owner in (None, node.func.value.id) and node.args):
            path = _path_value(node.args[0], names)
            if path is not None:
                route = table.setdefault(path, Route())
                route.methods |= _methods(node)
                endpoint = node.args[1] if len(node.args) > 1 else None
                if isinstance(endpoint, ast.Name) and endpoint.id in funcs:
                    route.handlers.append(funcs[endpoint.id])
    included: list[tuple[str, str]] = []  # (module, router variable in it)
    imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imports[alias.asname or alias.name] = (node.module, alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "include_router"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == owner):
            arg = node.args[0]
            assert isinstance(arg, ast.Name) and arg.id in imports, f"unreadable include_router in {source}"
            included.append(imports[arg.id])
    return included


_TABLE: dict[str, Route] | None = None


def pin_routes() -> dict[str, Route]:
    """path -> methods and handlers, from the pinned http_server.py and the routers it includes."""
    global _TABLE
    if _TABLE is None:
        table: dict[str, Route] = {}
        for module, var in _routes_of(pin_file(HTTP_SERVER), "app", table):
            _routes_of(pin_file(module.replace(".", "/") + ".py"), var, table)
        _TABLE = table
    return _TABLE


def vllm_routes() -> dict[str, Route]:
    """path -> methods of every route the installed vLLM declares under vllm/entrypoints/."""
    found = sorted(VLLM_PYTHON.parent.parent.glob("lib/python3*/site-packages/vllm/entrypoints"))
    if not found:
        pytest.fail(f"vLLM is not installed in {VLLM_PYTHON.parent.parent}; run `bash scripts/install-vllm.sh`",
                    pytrace=False)
    table: dict[str, Route] = {}
    for source in sorted(found[0].rglob("*.py")):
        _routes_of(source, None, table)
    return {path: route for path, route in table.items() if path.startswith("/")}


def concrete(path: str) -> str:
    """A route path with its parameters filled in (`/v1/models/{name}` -> `/v1/models/x`)."""
    return re.sub(r"\{[^}]*\}", "x", path)
