"""Multi-turn episodes (spec.rollout.episode other than single-turn): a group is `groupSize` episodes
of one prompt, each run by the job's episode function against a WorkerEpisodeContext.

Every model turn goes through GroupGenerator.sample (continued across aborts and the segment cap,
each token labelled with the weights that produced it), so the staleness bound and the weight
labels hold inside an episode as for one answer: an update between two turns, or inside one, gives
the later tokens the newer version.

The group sent to the trainer: its prompt is what every episode's prompt shares (the common prefix
of their prompt tokens), and each sample's response is the rest of its episode, the model's turns
trained and everything else (observations, tool results, the template's glue) masked from the loss.

Failures: an episode function that raises (or runs past episodeLimits.timeoutSeconds) is tried again
up to episodeLimits.retries times; after that the whole group is refused (FailedEpisodes: dropped,
dead-lettered with the reason, counted), never published with a made-up reward. A reward that
failed (RewardFailed) refuses it the same way as for single answers (UnscoredGroup). An engine
that went away (Dropped) is not the episode's fault: it propagates, and the worker queues the
prompt again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.api.episodes import Episode, EpisodeContext, EpisodeFn, EpisodeLimit, Role, ToolCall, ToolResult
from asyncrl.api.spec import EpisodeLimits, RolloutSpec
from asyncrl.infra.errors import RolloutError
from asyncrl.infra.plugins import import_callable
from asyncrl.rollout.data.datasets import PromptItem
from asyncrl.rollout.data.mixture import Lane
from asyncrl.rollout.data.prompts import ChatTurns, PromptRenderer
from asyncrl.rollout.episodes.builtin import BUILTIN_EPISODES
from asyncrl.rollout.episodes.tools import Toolbox, ToolError, parse_tool_calls
from asyncrl.rollout.generation.engine_view import Dropped
from asyncrl.rollout.generation.groups import (
    FailedEpisodes,
    GroupGenerator,
    InvalidGroup,
    UnscoredGroup,
    all_or_none,
)
from asyncrl.rollout.generation.producer import Answer, GroupProducer, SingleTurn, Turns
from asyncrl.rollout.rewards.functions import RewardFailed, Scorer
from asyncrl.transport.content import check_group
from asyncrl.transport.wire import EpisodeStats, TrajectoryGroup, TrajectorySample

log = logging.getLogger("asyncrl.rollout.episodes")


class EpisodeError(RolloutError, ValueError):
    """spec.rollout.episode names an episode that cannot be used."""


def resolve_episode(name: str) -> EpisodeFn:
    """A builtin episode by name, or `package.module:function`."""
    if name in BUILTIN_EPISODES:
        return BUILTIN_EPISODES[name]
    fn = import_callable(name, "episode", builtins=["single-turn", *BUILTIN_EPISODES], error=EpisodeError)
    if not inspect.iscoroutinefunction(fn):
        raise EpisodeError(f"episode plug-in {name!r} must be an async function (async def fn(ctx, sample))")
    return fn


class EpisodeFailed(Exception):
    """An episode function failed on every try (the reason of the last one)."""


def sample_of(item: PromptItem) -> dict[str, Any]:
    """The dataset record as an episode function is given it: prompt, answer, prompt_id, messages
    (when the dataset has them) and the metadata columns."""
    sample: dict[str, Any] = dict(item.metadata or {})
    sample.update(prompt=item.question, answer=item.answer, prompt_id=item.prompt_id)
    if item.messages:
        sample["messages"] = [dict(m) for m in item.messages]
    return sample


def item_of(sample: dict[str, Any], item: PromptItem) -> PromptItem:
    """The PromptItem an episode's (possibly edited) sample renders as."""
    messages = sample.get("messages")
    return PromptItem(prompt_id=item.prompt_id, question=str(sample.get("prompt", item.question)),
                      answer=str(sample.get("answer", item.answer)),
                      messages=list(messages) if messages else None, metadata=item.metadata)


@dataclass
class EpisodeRunner:
    """The job's episode function and what its contexts share (tools, the chat template, limits)."""

    fn: EpisodeFn
    limits: EpisodeLimits
    chat: ChatTurns
    decode: Callable[[list[int]], str]
    toolbox: Toolbox | None = None
    name: str = ""
    """spec.rollout.episode (for the logs and the dead letters)."""
    failures: int = 0
    """Episode tries that raised or timed out (each retry counts)."""

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.toolbox.schemas if self.toolbox is not None else None

    async def answer(self, turns: Turns, item: PromptItem, render: Callable[[PromptItem], list[int]],
                     scorer: Scorer) -> Answer:
        """One evaluation episode (tried once: what its turns raise, e.g. an abort, ends it)."""
        ep = await self.run(WorkerEpisodeContext(self, turns, item, render, scorer))
        return Answer(len(ep.ids), float(ep.reward or 0.0))

    async def group(self, generator: GroupGenerator, item: PromptItem, lane: Lane) -> TrajectoryGroup:
        """The prompt's trainable group of episodes; raises Dropped (the engine failed past its budget),
        FailedEpisodes (an episode failed past its retries), UnscoredGroup (a reward failed) or
        InvalidGroup (check_group refuses it)."""
        created = time.time()
        contexts: list[WorkerEpisodeContext | None] = [None] * generator.cfg.group_size

        async def one(slot: int) -> Episode:
            problem = ""
            for _ in range(self.limits.retries + 1):
                ctx = contexts[slot] = WorkerEpisodeContext(self, generator, item, lane.render, lane.scorer)
                try:
                    return await self.run(ctx)
                except (Dropped, RewardFailed):
                    raise
                except asyncio.TimeoutError:
                    problem = f"ran past episodeLimits.timeoutSeconds ({self.limits.timeout_seconds:g}s)"
                except Exception as exc:  # a user's episode function may raise anything
                    problem = f"{type(exc).__name__}: {exc}"
                self.failures += 1
                log.warning("episode %s of prompt %s failed: %s", self.name, item.prompt_id, problem)
            raise EpisodeFailed(f"episode {self.name} failed ({self.limits.retries + 1} tries): {problem}")

        try:
            episodes = await all_or_none([one(i) for i in range(generator.cfg.group_size)])
        except (EpisodeFailed, RewardFailed) as exc:
            partial = [c.episode for c in contexts if c is not None and c.episode is not None]
            group = self.to_group(generator, item, lane, partial, created, fallback=generator.view.version)
            kind = FailedEpisodes if isinstance(exc, EpisodeFailed) else UnscoredGroup
            raise kind(str(exc), group) from exc
        group = self.to_group(generator, item, lane, episodes, created, fallback=generator.view.version)
        problem = check_group(group, generator.limits)
        if problem is not None:
            raise InvalidGroup(problem)
        return group

    async def run(self, ctx: WorkerEpisodeContext) -> Episode:
        """One try of the episode function in `ctx`: its episode, ended and scored; raises what it raised
        (a time-out as asyncio.TimeoutError) or ValueError/TypeError for an episode that cannot be used."""
        sample = sample_of(ctx.item)
        try:
            ep = await asyncio.wait_for(self.fn(ctx, sample), timeout=self.limits.timeout_seconds)
        except EpisodeLimit:
            if ctx.episode is None:
                raise
            ep = ctx.episode
        if not isinstance(ep, Episode):
            raise TypeError(f"the episode function returned {type(ep).__name__}, not an Episode")
        if ep.turns == 0:
            raise ValueError("the episode has no model turn (call ctx.generate at least once)")
        if ep.reward is None:
            ep.reward = await ctx.score(ep)
        if not isinstance(ep.reward, (int, float)) or isinstance(ep.reward, bool) or not math.isfinite(ep.reward):
            raise ValueError(f"the episode's reward must be a finite number, got {ep.reward!r}")
        return ep

    def to_group(self, generator: GroupGenerator, item: PromptItem, lane: Lane, episodes: list[Episode],
                 created: float, *, fallback: int) -> TrajectoryGroup:
        """The group on the wire: the shared prompt, each episode's rest as a masked response."""
        shared = _common_prefix([ep.prompt_ids for ep in episodes]) if episodes else []
        samples = []
        for i, ep in enumerate(episodes):
            lead = ep.prompt_ids[len(shared):]
            mask = [False] * len(lead) + ep.mask
            lead_labels: list[int | None] = [None] * len(lead)
            versions = _filled(lead_labels + ep.versions, fallback)
            timelines = _filled(lead_labels + ep.timelines, 0)
            reward = math.nan if ep.reward is None else float(ep.reward)
            samples.append(TrajectorySample(
                sample_index=i, response_ids=np.asarray(lead + ep.ids, dtype=np.int32),
                behav_logprobs=np.asarray([0.0] * len(lead) + ep.logprobs, dtype=np.float32),
                versions=np.asarray(versions, dtype=np.int32), reward=reward,
                finish_reason="length" if ep.truncated else ep.finish,
                timelines=np.asarray(timelines, dtype=np.int32) if any(timelines) else None,
                loss_mask=None if all(mask) else np.asarray(mask, dtype=bool),
                episode=EpisodeStats(turns=ep.turns, tool_calls=ep.tool_calls, tool_errors=ep.tool_errors,
                                     tool_seconds=ep.tool_seconds, generate_seconds=ep.generate_seconds)))
        return TrajectoryGroup(
            job=generator.cfg.job, group_id=uuid.uuid4().hex, prompt_id=item.prompt_id,
            prompt_ids=np.asarray(shared, dtype=np.int32), samples=samples, engine_id=generator.cfg.engine_id,
            created_at=created, published_at=time.time(), source=lane.name)


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return first[:n]


def _filled(labels: list[int | None], fallback: int) -> list[int]:
    """Context tokens take the label of the model token before them (or, leading, the one after):
    they are never trained, and so never make a group look older than its generated tokens."""
    known = [x for x in labels if x is not None]
    last = known[0] if known else fallback
    out = []
    for x in labels:
        last = last if x is None else x
        out.append(last)
    return out


class WorkerEpisodeContext(EpisodeContext):
    """One episode's context on a rollout worker: its turns' source, its prompt's rendering and reward."""

    def __init__(self, runner: EpisodeRunner, turns: Turns, item: PromptItem,
                 render: Callable[[PromptItem], list[int]], scorer: Scorer) -> None:
        self.runner, self.turns, self.item, self.render, self.scorer = runner, turns, item, render, scorer
        self.max_turns = runner.limits.max_turns
        self.max_tokens = runner.limits.max_tokens
        self.episode: Episode | None = None
        """The episode this context started last (what a failed or limited episode leaves)."""

    def start(self, sample: dict[str, Any]) -> Episode:
        ep = Episode(sample=sample, prompt_ids=self.render(item_of(sample, self.item)),
                     _observe=self._observe, _max_tokens=self.max_tokens)
        if ep.room is not None and ep.room <= 0:
            raise EpisodeLimit(f"the prompt alone has {len(ep.prompt_ids)} tokens, episodeLimits.maxTokens "
                               f"is {self.max_tokens}")
        self.episode = ep
        return ep

    def _observe(self, text: str, role: Role) -> list[int]:
        return self._closing_turn() + self.runner.chat.observation(text, role)

    def _closing_turn(self) -> list[int]:
        """The end-of-turn token when the last model turn stopped without it (cut at its length)."""
        ep, eot = self.episode, self.runner.chat.end_of_turn
        if ep is None or eot is None or not ep.mask or not ep.mask[-1] or ep.ids[-1] == eot:
            return []
        return [eot]

    async def generate(self, ep: Episode) -> str:
        if ep.turns >= self.max_turns:
            raise EpisodeLimit(f"episodeLimits.maxTurns ({self.max_turns}) reached")
        if ep.ids and not ep.mask[-1]:  # after an observation: open the model's turn
            ep.add_context(self.runner.chat.generation_prompt())
        room = ep.room if ep.room is not None else self.turns.max_new_tokens
        if room <= 0:
            ep.truncated = True
            raise EpisodeLimit(f"episodeLimits.maxTokens ({self.max_tokens}) reached")
        start = time.monotonic()
        turn = await self.turns.sample(ep.prompt_ids + ep.ids, budget=min(self.turns.max_new_tokens, room))
        ep.generate_seconds += time.monotonic() - start
        text = self.runner.decode(turn.ids)
        ep.add_turn(turn.ids, turn.logprobs, turn.versions, turn.timelines, text, turn.finish)
        if turn.finish == "length" and len(turn.ids) >= room:
            ep.truncated = True
        return text

    async def score(self, ep: Episode, completion: str | None = None) -> float:
        return await self.scorer.score(ep.last_text if completion is None else completion,
                                            str(ep.sample.get("answer", self.item.answer)), self.item.question,
                                            metadata=self.item.metadata)

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return parse_tool_calls(text)

    async def call_tools(self, ep: Episode, text: str | None = None) -> list[ToolResult]:
        calls = self.parse_tool_calls(ep.last_text if text is None else text)
        if not calls:
            return []
        toolbox = self.runner.toolbox
        if toolbox is None:
            results = [ToolResult(c, "Error: this job has no tools (spec.rollout.tools)", error=True) for c in calls]
        else:
            results = list(await asyncio.gather(*[toolbox.run(c) for c in calls]))
        for result in results:
            ep.tool_calls += 1
            ep.tool_errors += int(result.error)
            ep.tool_seconds += result.seconds
            ep.add_observation(result.content, "tool")
        return results


def group_producer(rollout: RolloutSpec, tokenizer: object, renderer: PromptRenderer) -> GroupProducer:
    """The job's producer: its multi-turn episode, or SingleTurn; raises EpisodeError naming the field at fault."""
    if not rollout.multi_turn():
        return SingleTurn(renderer.decode)
    try:
        fn = resolve_episode(rollout.episode)
    except EpisodeError as exc:
        raise EpisodeError(f"spec.rollout.episode: {exc}") from exc
    try:
        toolbox = Toolbox(rollout.tools, timeout_s=rollout.tool_timeout_seconds,
                          max_concurrent=rollout.max_concurrent_tool_calls) if rollout.tools else None
    except ToolError as exc:
        raise EpisodeError(f"spec.rollout.tools: {exc}") from exc
    return EpisodeRunner(fn, rollout.episode_limits, ChatTurns(tokenizer, renderer.stop_token_ids()),
                         renderer.decode, toolbox, name=rollout.episode)
