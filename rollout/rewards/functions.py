"""Reward functions: `gsm8k` (math-verify), `exact-number`, and `module:function` plug-ins.

A reward function is `fn(completion: str, answer: str) -> float`, where `answer` is the dataset's
reference (a bare number, or a GSM8K solution ending in `#### n`); a plug-in that also has a `metadata`
parameter is given the prompt's dataset.metadataFields columns (a dict, or None when the dataset has
none), so a verifier can use e.g. a record's test cases. `RewardScorer` runs it off the
event loop with a per-call timeout; a call that raises, times out or returns a non-number is
counted, logged and tried again up to `retries` times. A sample whose reward still failed raises
`RewardFailed` (`on_error="drop"`: its group is dropped, never trained with a made-up reward) or
scores 0.0 (`on_error="zero"`), so a bad sample never crashes the worker.

Answer extraction (both built-ins), first match wins: the text after the last `####`, the last
`\\boxed{...}`, the number after the last "answer is", else the last number in the text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

from asyncrl.infra.errors import RolloutError
from asyncrl.infra.plugins import import_callable

log = logging.getLogger("asyncrl.rollout.rewards.functions")

RewardFn = Callable[..., float]
"""fn(completion, answer) -> float, optionally with a `metadata` keyword parameter."""
Metadata = dict[str, Any]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_BOXED_RE = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)


class RewardError(RolloutError, ValueError):
    """A reward name that cannot be resolved into a function."""


def extract_answer(text: str) -> str | None:
    """The final-answer substring of a completion or reference, or None if it has none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        m = _NUMBER_RE.search(tail)
        return m.group(0) if m else (tail.splitlines()[0].strip() if tail else None)
    boxed = _BOXED_RE.findall(text)
    if boxed:
        return boxed[-1].strip()
    said = _ANSWER_IS_RE.findall(text)
    if said:
        return said[-1]
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _to_float(s: str | None) -> float | None:
    if s is None:
        return None
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def exact_number_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the reference number (|diff| <= 1e-6)."""
    gold, pred = _to_float(extract_answer(answer)), _to_float(extract_answer(completion))
    if gold is None or pred is None:
        return 0.0
    return 1.0 if math.isclose(gold, pred, rel_tol=0.0, abs_tol=1e-6) else 0.0


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8K: extract both final answers and compare them with math-verify (symbolic equality)."""
    from math_verify import parse, verify

    gold_text, pred_text = extract_answer(answer), extract_answer(completion)
    if gold_text is None or pred_text is None:
        return 0.0

    def clean(s: str) -> str:
        return s.replace(",", "").replace("$", "").strip().rstrip(".")

    # Timeouts are ours (RewardScorer): math-verify's own use SIGALRM, which works only in the main thread.
    gold = parse(clean(gold_text), parsing_timeout=None)
    pred = parse(clean(pred_text), parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "exact-number": exact_number_reward}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, or `package.module:function` imported from the Python path."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    return import_callable(name, "reward", builtins=BUILTIN_REWARDS, error=RewardError)


def takes_metadata(fn: RewardFn) -> bool:
    """Whether a reward function has a `metadata` parameter (or **kwargs), so it is given the
    prompt's metadata; one without keeps the plain (completion, answer) call."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return "metadata" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class RewardFailed(Exception):
    """A sample's reward could not be computed (every call raised, timed out or returned a
    non-finite number): an infrastructure failure, not a wrong answer."""


OnError = Literal["drop", "zero"]


def tries(retries: int) -> str:
    return f"{retries + 1} tr{'y' if retries == 0 else 'ies'}"


def give_up(on_error: OnError, message: str) -> float:
    """A reward that failed on every try: RewardFailed ("drop"), or 0.0 with a warning ("zero")."""
    if on_error == "drop":
        raise RewardFailed(message)
    log.warning("%s (scored 0: reward.onError is zero)", message)
    return 0.0


async def settled(scores: Sequence[Awaitable[float]]) -> list[float | RewardFailed]:
    """Await every score: a failed reward becomes its RewardFailed in place, anything else raised
    (a cancellation, a bug) is raised."""
    results = await asyncio.gather(*scores, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, RewardFailed):
            raise result
    return results  # type: ignore[return-value]  # (only floats and RewardFailed are left)


class Scorer(Protocol):
    """What the rollout worker and the evaluator score with: in-process (RewardScorer) or over
    HTTP (rollout/rewards/client.py's HttpRewardScorer)."""

    name: str
    errors: int
    """Failures seen, each try counted (a call that raised, a request or an item that failed)."""
    retried: int
    """Tries again after a failure (the job's reward.retries)."""

    async def score(self, completion: str, answer: str, prompt: str = "", *, metadata: Metadata | None = None) -> float:
        """One completion's reward (raises RewardFailed, or 0.0 under on_error "zero"); `metadata`:
        the prompt's dataset.metadataFields columns."""
        ...

    async def score_all(self, completions: Sequence[str], answer: str, prompt: str = "", *,
                        metadata: Metadata | None = None) -> list[float | RewardFailed]:
        """A group's rewards, in order; a completion whose reward failed gets its RewardFailed."""
        ...

    async def ready(self) -> bool:
        """Whether scoring can start (a service answers its health check)."""
        ...

    def close(self) -> None: ...


@dataclass
class RewardScorer:
    """Runs a reward function in worker threads with a timeout and bounded retries."""

    fn: RewardFn
    timeout_s: float = 5.0
    max_workers: int = 4
    name: str = ""
    retries: int = 0
    on_error: OnError = "zero"
    errors: int = 0
    """Calls that failed (each retry counts)."""
    retried: int = 0
    """Calls made again after a failure."""
    timeouts: int = 0
    """Of `errors`: calls that timed out."""
    failed: int = 0
    """Samples whose reward failed on every try (raised RewardFailed, or scored 0 under "zero")."""
    scored: int = 0
    _pool: concurrent.futures.ThreadPoolExecutor = field(init=False, repr=False)
    _takes_metadata: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="reward")
        self._takes_metadata = takes_metadata(self.fn)

    @classmethod
    def from_name(cls, name: str, timeout_s: float = 5.0, *, retries: int = 0,
                  on_error: OnError = "zero") -> RewardScorer:
        return cls(resolve_reward(name), timeout_s, name=name, retries=retries, on_error=on_error)

    async def score_all(self, completions: Sequence[str], answer: str, prompt: str = "", *,
                        metadata: Metadata | None = None) -> list[float | RewardFailed]:
        return await settled([self.score(c, answer, metadata=metadata) for c in completions])

    async def score(self, completion: str, answer: str, prompt: str = "", *, metadata: Metadata | None = None) -> float:
        self.scored += 1
        problem = ""
        call = partial(self.fn, completion, answer, **({"metadata": metadata} if self._takes_metadata else {}))
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
            try:
                return await self._call(call)
            except asyncio.TimeoutError:
                # The thread cannot be killed; it finishes in the background and its result is ignored.
                self.timeouts += 1
                problem = f"timed out after {self.timeout_s:g}s"
            except Exception as exc:  # a plug-in may raise anything
                problem = f"{type(exc).__name__}: {exc}"
            self.errors += 1
        self.failed += 1
        return give_up(self.on_error, f"reward {self.name or self.fn!r} failed ({tries(self.retries)}): {problem}")

    async def ready(self) -> bool:
        return True

    async def _call(self, call: Callable[[], float]) -> float:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, call)
        value = float(await asyncio.wait_for(fut, timeout=self.timeout_s))
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
