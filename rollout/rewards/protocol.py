"""The reward service's JSON protocol: one POST scores a group's completions.

    POST <url>/score   {"items": [{"completion": "...", "answer": "42", "prompt": "What is 40 + 2?",
                                   "metadata": {"level": 1}}, ...]}
    200                {"scores": [{"score": 1.0}, {"error": "verifier crashed: ..."}, ...]}

`metadata` (optional, absent when the dataset has no metadataFields) holds the prompt's
dataset.metadataFields columns, column name -> the record's value (any JSON value).

One answer per item, in order: `score` (a finite number) or `error` (this item could not be scored:
an infrastructure failure, never a wrong answer). `GET <url>/health` answers 200 when the service
can score. With an API key the service wants `Authorization: Bearer <key>` on /score (401 without).
A reply that breaks these rules (another count, a non-finite score, neither field) fails the whole
request. `asyncrl reward-server` serves any reward function with it (rollout/rewards/server.py);
`HttpRewardScorer` (rollout/rewards/client.py) is the client the rollout worker uses.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.api.runtime import ENV_REWARD_API_KEY

__all__ = ["DEFAULT_PORT", "ENV_REWARD_API_KEY", "HEALTH_PATH", "SCORE_PATH", "ItemScore", "ScoreItem",
           "ScoreRequest", "ScoreResponse"]

SCORE_PATH = "/score"
HEALTH_PATH = "/health"
DEFAULT_PORT = 8100


class ScoreItem(BaseModel):
    """One completion to score, with its dataset record's reference answer, prompt and metadata."""

    model_config = ConfigDict(extra="forbid")
    completion: str
    answer: str
    prompt: str = ""
    metadata: dict[str, Any] | None = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[ScoreItem] = Field(min_length=1, max_length=4096)


class ItemScore(BaseModel):
    """Exactly one of `score` (finite) and `error`."""

    model_config = ConfigDict(extra="forbid")
    score: float | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ItemScore:
        if (self.score is None) == (self.error is None):
            raise ValueError("an item's answer has exactly one of `score` and `error`")
        if self.score is not None and not math.isfinite(self.score):
            raise ValueError(f"score is not finite: {self.score}")
        return self


class ScoreResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scores: list[ItemScore]
