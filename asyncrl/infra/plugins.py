"""`module:function` plug-ins named in a job file (rewards, episodes, tools), imported from the Python path."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def import_callable(name: str, what: str, *, builtins: Iterable[str], error: type[Exception]) -> Callable[..., Any]:
    """`package.module:function` imported; `error` (naming `what`, the builtins and the module) when it cannot be."""
    if ":" not in name:
        raise error(f"unknown {what} {name!r}; allowed: {', '.join(builtins)}, or module:function")
    module_name, func_name = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} plug-in {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise error(f"{what} plug-in {name!r}: {module_name} has no function {func_name!r}")
    return fn
