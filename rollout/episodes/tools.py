"""Tools an episode's model may call (spec.rollout.tools): described in the prompt, parsed, run.

A tool is a Python function with type hints and a Google-style docstring (`Args:` names and
describes each parameter): `calculator`, built in, or `module:function`. Its JSON schema is
transformers' `get_json_schema`, the format chat templates take in `tools=`. The model calls tools
Hermes/Qwen style, one JSON object per block:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Calls run off the event loop (a sync function in a thread, an async one awaited) with a per-call
timeout and a job-wide concurrency limit per worker. Whatever goes wrong in a call (malformed JSON,
an unknown tool, bad arguments, an exception, a timeout) is the environment's answer, an error
message the model reads, not an infrastructure failure.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import inspect
import json
import math
import operator
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.api.episodes import ToolCall, ToolResult
from asyncrl.infra.errors import RolloutError
from asyncrl.infra.plugins import import_callable

_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
MAX_RESULT_CHARS = 4000
"""A tool's answer is cut to this many characters (a runaway result must not fill the context)."""


class ToolError(RolloutError, ValueError):
    """spec.rollout.tools names a tool that cannot be used."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    try:
        value = _evaluate(ast.parse(expression.replace("^", "**"), mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer():
            return str(int(value))
        return repr(round(value, 10))
    return str(value)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


def resolve_tool(name: str) -> Callable[..., Any]:
    """A builtin tool by name, or `package.module:function`."""
    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    return import_callable(name, "tool", builtins=BUILTIN_TOOLS, error=ToolError)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema for the chat template (its docstring must describe every parameter)."""
    from transformers.utils import get_json_schema  # (rollout extra only: the core package has no transformers)

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises its own TypeError subclasses on undocumented parameters
        raise ToolError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {exc}") from exc


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>` blocks of a model turn (an unterminated last one counts: the turn may have
    stopped inside it); a block that is not a call carries its `error`."""
    calls = []
    for body in _CALL_RE.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": "<tool>", "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # (some models write the arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


class Toolbox:
    """The job's tools (spec.rollout.tools) with their schemas, run with a timeout and a concurrency limit."""

    def __init__(self, names: Sequence[str], *, timeout_s: float = 30.0, max_concurrent: int = 16) -> None:
        self.tools = {}
        for name in names:
            fn = resolve_tool(name)
            self.tools[fn.__name__] = fn
        self.schemas = [tool_schema(fn) for fn in self.tools.values()]
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix="tool")

    async def run(self, call: ToolCall) -> ToolResult:
        """The call's answer; never raises (every failure is an error message for the model)."""
        if call.error is not None:
            return ToolResult(call, f"Error: {call.error}", error=True)
        fn = self.tools.get(call.name)
        if fn is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call, f"Error: there is no tool {call.name!r} (tools: {known})", error=True)
        start = time.monotonic()
        async with self._slots:
            try:
                value = await asyncio.wait_for(self._call(fn, call.arguments), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                return ToolResult(call, f"Error: {call.name} did not answer within {self.timeout_s:g}s",
                                  error=True, seconds=time.monotonic() - start)
            except Exception as exc:  # a tool may raise anything: the model is told
                return ToolResult(call, f"Error: {type(exc).__name__}: {exc}", error=True,
                                  seconds=time.monotonic() - start)
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return ToolResult(call, text[:MAX_RESULT_CHARS], seconds=time.monotonic() - start)

    async def _call(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(**arguments)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(**arguments))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
