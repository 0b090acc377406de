"""Scoring with a judge model (spec.reward.judge) behind an OpenAI-compatible chat completions API.

One request per answer: the judge's prompt (the job's template over the question, the answer to
grade and the reference answer) as the user message, the score asked for as `{"score": n}` with a
JSON schema (`response_format`, which vLLM, SGLang and OpenAI enforce while decoding), or read as
the last integer of a free-text reply. The reward is score / maxScore. A request that fails as a
whole is retried like a reward service's (rollout/rewards/client.py); a reply without a score in
0..maxScore is the judge's failure, not a wrong answer: it fails the reward (`onError`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.spec import JudgeSpec
from asyncrl.rollout.rewards.client import Refused, answers_ok, post_json, with_retries
from asyncrl.rollout.rewards.functions import Metadata, OnError, RewardFailed, give_up, settled, tries

_LAST_INTEGER = re.compile(r"(?<![\d.])-?\d+(?![\d.])")


def judge_request(judge: JudgeSpec, *, completion: str, answer: str, prompt: str) -> dict[str, Any]:
    """The chat completions body asking `judge` to score one answer."""
    user = judge.prompt_template.format(prompt=prompt, completion=completion, answer=answer, max_score=judge.max_score)
    messages = [{"role": "system", "content": judge.system_prompt}] if judge.system_prompt else []
    body: dict[str, Any] = {"model": judge.model, "messages": [*messages, {"role": "user", "content": user}],
                            "temperature": judge.temperature, "max_tokens": judge.max_tokens}
    if judge.structured_output:
        schema = {"type": "object", "additionalProperties": False, "required": ["score"],
                  "properties": {"score": {"type": "integer", "minimum": 0, "maximum": judge.max_score}}}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "score", "schema": schema,
                                                                          "strict": True}}
    return body


def parse_score(reply: str, *, max_score: int, structured: bool) -> float:
    """The reward in a judge's reply (score / max_score); ValueError when it holds none in range."""
    if structured:
        try:
            doc = json.loads(reply)
        except json.JSONDecodeError:
            raise ValueError(f"the reply is not the JSON asked for: {reply[:120]!r}") from None
        score = doc.get("score") if isinstance(doc, dict) else None
        if not isinstance(score, int) or isinstance(score, bool):
            raise ValueError(f"the reply has no integer `score`: {reply[:120]!r}")
    else:
        found = _LAST_INTEGER.findall(reply)
        if not found:
            raise ValueError(f"no score in the reply: {reply[:120]!r}")
        score = int(found[-1])
    if not 0 <= score <= max_score:
        raise ValueError(f"score {score} is outside 0..{max_score}")
    return score / max_score


def reply_text(body: Any) -> str:
    """`choices[0].message.content` of a chat completion; ValueError for anything else."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("not a chat completion (no choices[0].message.content)") from None
    if not isinstance(content, str):
        raise ValueError("the reply has no text content")
    return content


@dataclass
class JudgeScorer:
    """Scores answers with a judge model (see the module doc)."""

    judge: JudgeSpec
    retries: int = 1
    on_error: OnError = "drop"
    name: str = ""
    errors: int = 0
    """Requests that failed as a whole, or whose reply held no score (each retry counts)."""
    retried: int = 0
    """Requests sent again."""
    failed: int = 0
    """Answers whose reward failed (raised RewardFailed, or scored 0 under "zero")."""
    scored: int = 0
    api_key: str | None = field(init=False, repr=False, default=None)
    _slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.name = self.name or f"judge {self.judge.model} at {self.judge.url}"
        self.api_key = os.environ.get(self.judge.api_key_env) if self.judge.api_key_env else None
        self._slots = asyncio.Semaphore(self.judge.max_concurrent_requests)

    async def score(self, completion: str, answer: str, prompt: str = "", *, metadata: Metadata | None = None) -> float:
        self.scored += 1
        body = judge_request(self.judge, completion=completion, answer=answer, prompt=prompt)
        try:
            return await with_retries(lambda: self._ask(body), retries=self.retries, slots=self._slots,
                                      what=self.name, counts=self)
        except Refused as exc:
            self.failed += 1
            return give_up(self.on_error, f"{self.name} failed ({tries(self.retries)}): {exc}")

    async def score_all(self, completions: Sequence[str], answer: str, prompt: str = "", *,
                        metadata: Metadata | None = None) -> list[float | RewardFailed]:
        return await settled([self.score(c, answer, prompt, metadata=metadata) for c in completions])

    async def _ask(self, body: dict[str, Any]) -> float:
        resp = await post_json(self.judge.url + "/chat/completions", body, timeout_s=self.judge.timeout_seconds,
                               api_key=self.api_key)
        try:
            return parse_score(reply_text(resp.json()), max_score=self.judge.max_score,
                               structured=self.judge.structured_output)
        except ValueError as exc:  # (asked again: a sampled judge may answer in range the next time)
            raise Refused(str(exc), retry=True) from exc

    async def ready(self) -> bool:
        return await answers_ok(self.judge.url + "/models", self.api_key)

    def close(self) -> None:
        """Nothing held between requests (one connection per request)."""
