"""The episode API: what a multi-turn episode function is written against (spec.rollout.episode).

    from asyncrl.api.episodes import Episode, EpisodeContext

    async def my_episode(ctx: EpisodeContext, sample: dict) -> Episode:
        ep = ctx.start(sample)              # the prompt, rendered with the job's chat template
        text = await ctx.generate(ep)       # one model turn: trained tokens, with log-probs and versions
        ep.add_observation("...")           # an environment turn: context, never in the loss
        ep.reward = await ctx.score(ep)     # or any float
        return ep

Token in, token out: an episode is one token sequence that only ever grows. The model's turns are
appended as the engine sampled them (never re-tokenised), an observation as the chat template's
tokens for that message, so the trainer sees exactly the tokens the policy was conditioned on.

Failures are not rewards: an episode function that raises is tried again (episodeLimits.retries)
and then its whole group is dropped, counted and dead-lettered; it is never trained with a made-up
reward. Running out of turns or tokens is not a failure: `generate` raises EpisodeLimit, and the
episode ends there (scored with the job's reward if it has no reward yet).

This module needs neither torch nor an engine: user code imports it alone.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["user", "tool", "system"]
EpisodeFn = Callable[["EpisodeContext", dict[str, Any]], Awaitable["Episode"]]
"""async fn(ctx, sample) -> Episode: spec.rollout.episode's `module:function`."""


class EpisodeLimit(Exception):
    """The episode reached spec.rollout.episodeLimits (maxTurns or maxTokens): it ends here, as it is."""


@dataclass
class ToolCall:
    """One call the model wrote (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`);
    `error` says why it cannot be run (malformed JSON, an unknown tool), else None."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclass
class ToolResult:
    """A call's answer as the model is shown it; `error` True when it is an error message."""

    call: ToolCall
    content: str
    error: bool = False
    seconds: float = 0.0


@dataclass
class Episode:
    """One episode's token sequence after its prompt: the model's turns (trained) and context
    (observations, tool results, chat-template glue: masked from the loss), with its counters.

    Tokens are only appended, by `EpisodeContext.generate` and `add_observation`; per token:
    `logprobs` (the behaviour log-prob, 0.0 for context), `versions` and `timelines` (the weights
    that produced it; context takes its neighbours') and `mask` (True: trained)."""

    sample: dict[str, Any]
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    timelines: list[int | None] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    reward: float | None = None
    """Set by the episode function; left None, the job's reward scores the last model turn."""
    turns: int = 0
    """Model turns generated."""
    texts: list[str] = field(default_factory=list)
    """Each model turn's text, in order."""
    finish: str = "stop"
    """How the last model turn ended: stop (end of turn) or length."""
    truncated: bool = False
    """The episode hit episodeLimits.maxTokens (a turn or an observation was cut short)."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    generate_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    """Free for the episode function (not sent to the trainer)."""
    _observe: Callable[[str, Role], list[int]] | None = field(default=None, repr=False)
    _max_tokens: int | None = field(default=None, repr=False)

    @property
    def last_text(self) -> str:
        """The last model turn's text ("" before the first)."""
        return self.texts[-1] if self.texts else ""

    @property
    def room(self) -> int | None:
        """Tokens left under episodeLimits.maxTokens (prompt included); None: no limit."""
        return None if self._max_tokens is None else self._max_tokens - len(self.prompt_ids) - len(self.ids)

    def add_observation(self, text: str, role: Role = "user") -> None:
        """Append an environment or tool message, in the model's chat template, as context."""
        if self._observe is None:
            raise RuntimeError("this Episode was not made by EpisodeContext.start: it cannot render messages")
        self.add_context(self._observe(text, role))

    def add_context(self, ids: list[int]) -> None:
        """Append tokens the model did not choose (masked from the loss); cut at maxTokens."""
        room = self.room
        if room is not None and len(ids) > room:
            ids, self.truncated = ids[:max(room, 0)], True
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)
        self.timelines += [None] * len(ids)
        self.mask += [False] * len(ids)

    def add_turn(self, ids: list[int], logprobs: list[float], versions: list[int], timelines: list[int],
                 text: str, finish: str) -> None:
        """Append one model turn as sampled (EpisodeContext.generate's part)."""
        if not len(ids) == len(logprobs) == len(versions) == len(timelines):
            raise ValueError("a turn needs one logprob, version and timeline per token")
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.timelines += timelines
        self.mask += [True] * len(ids)
        self.texts.append(text)
        self.turns += 1
        self.finish = finish

    def trained_tokens(self) -> int:
        return sum(self.mask)


class EpisodeContext(abc.ABC):
    """What an episode function may do: the rollout worker gives one per episode."""

    max_turns: int
    """episodeLimits.maxTurns: `generate` raises EpisodeLimit past it."""
    max_tokens: int
    """episodeLimits.maxTokens (prompt and every turn): `generate` raises EpisodeLimit at it."""

    @abc.abstractmethod
    def start(self, sample: dict[str, Any]) -> Episode:
        """A new episode whose prompt is `sample` (its `prompt`, or `messages`) rendered with the job's
        chat template, system prompt and tool descriptions."""

    @abc.abstractmethod
    async def generate(self, ep: Episode) -> str:
        """One model turn continuing `ep`, appended to it; returns its text. Raises EpisodeLimit when
        the episode has no turn or token left."""

    @abc.abstractmethod
    async def score(self, ep: Episode, completion: str | None = None) -> float:
        """The job's reward (spec.reward) of `completion` (default: the last model turn) against the
        sample's answer. A reward that fails past its retries raises: the group is dropped, not zeroed."""

    @abc.abstractmethod
    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        """The `<tool_call>` blocks of a model turn, in order (malformed ones carry their `error`)."""

    @abc.abstractmethod
    async def call_tools(self, ep: Episode, text: str | None = None) -> list[ToolResult]:
        """Run the tool calls of `text` (default: the last model turn) with spec.rollout.tools and append
        each result to `ep` as a tool message; [] when the turn calls none. A malformed call, an unknown
        tool, one that raises or times out answers with an error message the model sees."""
