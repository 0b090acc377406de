"""Scoring over HTTP: the rollout worker's client of a reward service (spec.reward.service).

One POST per group (rollout/rewards/protocol.py), at most `max_concurrent_requests` in flight. The
worker owns the job's `reward.retries` for a service: a request that fails as a whole (unreachable, a
timeout, 408/429/5xx), and the items a reply answers with `error` (a flaky verifier, a sandbox that
timed out), are sent again after a back-off (0.5 s doubling, at most 8 s), up to `retries` more times
in all (a retry re-sends only the items still without a score); any other refusal (401, 422, ...) and
a reply that breaks the protocol are not retried (the same request would fail again). What a reward
that failed on every try becomes is `on_error` (rollout/rewards/functions.py `give_up`): RewardFailed,
or 0.0. `asyncrl reward-server --retries` retries inside the service besides (default 0: the job's
retries happen once, here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx
from pydantic import ValidationError

from asyncrl.api.runtime import secret_env
from asyncrl.rollout.engines.auth import auth_header
from asyncrl.rollout.rewards.functions import Metadata, OnError, RewardFailed, give_up, tries
from asyncrl.rollout.rewards.protocol import (
    ENV_REWARD_API_KEY,
    HEALTH_PATH,
    SCORE_PATH,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)

log = logging.getLogger("asyncrl.rollout.rewards.client")

T = TypeVar("T")
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
BACKOFF_S, BACKOFF_CAP_S = 0.5, 8.0


class Refused(Exception):
    """The request failed, or `failures` of its items did; `retry`: sending them again may succeed."""

    def __init__(self, message: str, *, retry: bool, failures: int = 1) -> None:
        super().__init__(message)
        self.retry = retry
        self.failures = failures


class UnscoredItems(Refused):
    """The reply answered `failures` items with an error (the others have their score)."""


class FailureCounts(Protocol):
    errors: int
    """Failures seen (each try counts)."""
    retried: int
    """Tries again (a request or an item sent again)."""


async def with_retries(send: Callable[[], Awaitable[T]], *, retries: int, slots: asyncio.Semaphore, what: str,
                       counts: FailureCounts) -> T:
    """`send()` within `slots`, again after a back-off (0.5 s doubling, at most 8 s) while it raises
    a retryable Refused, at most `retries` more times; each Refused's failures and retries counted."""
    delay = BACKOFF_S
    for attempt in range(retries + 1):
        try:
            async with slots:
                return await send()
        except Refused as exc:
            counts.errors += exc.failures
            if not exc.retry or attempt == retries:
                raise
            counts.retried += exc.failures
            log.warning("%s: %s; trying again in %.1fs", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, BACKOFF_CAP_S)
    raise AssertionError("unreachable")  # (the last attempt returns or raises)


async def post_json(url: str, body: Any, *, timeout_s: float, api_key: str | None) -> httpx.Response:
    """One POST; a transport failure or a 408/429/5xx is a retryable Refused, another non-200 a final one."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=auth_header(api_key)) as client:
            resp = await client.post(url, json=body)
    except httpx.TransportError as exc:  # unreachable, reset, timed out
        raise Refused(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, retry=True) from exc
    if resp.status_code != 200:
        raise Refused(f"HTTP {resp.status_code}: {resp.text[:200]}", retry=resp.status_code in RETRIED_STATUS)
    return resp


async def answers_ok(url: str, api_key: str | None = None) -> bool:
    """Whether GET `url` answers 200 (a readiness check)."""
    try:
        async with httpx.AsyncClient(timeout=5.0, headers=auth_header(api_key)) as client:
            return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class HttpRewardScorer:
    """Scores completions with a reward service (see the module doc)."""

    url: str
    timeout_s: float = 60.0
    max_concurrent: int = 8
    retries: int = 1
    on_error: OnError = "drop"
    api_key: str | None = field(default_factory=lambda: secret_env(ENV_REWARD_API_KEY), repr=False)
    name: str = ""
    errors: int = 0
    """Requests that failed as a whole, and items the service answered with an error (each try counts)."""
    retried: int = 0
    """Requests and items sent again."""
    failed: int = 0
    """Completions whose reward failed (raised RewardFailed, or scored 0 under "zero")."""
    scored: int = 0
    _slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.name = self.name or self.url
        self._slots = asyncio.Semaphore(self.max_concurrent)

    async def score(self, completion: str, answer: str, prompt: str = "", *, metadata: Metadata | None = None) -> float:
        (result,) = await self.score_all([completion], answer, prompt, metadata=metadata)
        if isinstance(result, RewardFailed):
            raise result
        return result

    async def score_all(self, completions: Sequence[str], answer: str, prompt: str = "", *,
                        metadata: Metadata | None = None) -> list[float | RewardFailed]:
        self.scored += len(completions)
        items = [ScoreItem(completion=c, answer=answer, prompt=prompt, metadata=metadata) for c in completions]
        scores: dict[int, float] = {}
        errors: dict[int, str] = {}

        async def send_unscored() -> None:
            pending = [i for i in range(len(items)) if i not in scores]
            answers = await self._post_once(ScoreRequest(items=[items[i] for i in pending]))
            for i, a in zip(pending, answers.scores, strict=True):
                if a.score is None:
                    errors[i] = str(a.error)
                else:
                    scores[i] = a.score
            unscored = [i for i in pending if i not in scores]
            if unscored:
                raise UnscoredItems(f"{len(unscored)} of {len(pending)} items answered with an error: "
                                    f"{errors[unscored[0]]}", retry=True, failures=len(unscored))

        try:
            await with_retries(send_unscored, retries=self.retries, slots=self._slots,
                               what=f"reward service {self.url}", counts=self)
        except Refused as exc:
            whole = None if isinstance(exc, UnscoredItems) else str(exc)  # (else each item's own error)
            return [scores[i] if i in scores else
                    self._give_up(f"reward service {self.url} failed ({tries(self.retries)}): {whole or errors[i]}")
                    for i in range(len(items))]
        return [scores[i] for i in range(len(items))]

    def _give_up(self, message: str) -> float | RewardFailed:
        self.failed += 1
        try:
            return give_up(self.on_error, message)
        except RewardFailed as exc:
            return exc

    async def _post_once(self, request: ScoreRequest) -> ScoreResponse:
        body = request.model_dump(mode="json", exclude_none=True)  # (no `metadata` key when there is none)
        resp = await post_json(self.url + SCORE_PATH, body, timeout_s=self.timeout_s, api_key=self.api_key)
        try:
            answers = ScoreResponse.model_validate_json(resp.content)
        except ValidationError as exc:
            raise Refused(f"a reply outside the protocol: {exc.errors()[0]['msg']}", retry=False) from exc
        if len(answers.scores) != len(request.items):
            raise Refused(f"a reply outside the protocol: {len(answers.scores)} scores for "
                          f"{len(request.items)} items", retry=False)
        return answers

    async def ready(self) -> bool:
        return await answers_ok(self.url + HEALTH_PATH)

    def close(self) -> None:
        """Nothing held between requests (one connection per request)."""
