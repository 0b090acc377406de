"""One prompt's group: its samples generated, scored, each token tagged with its version.

  sample()  one completion as a sequence of segments: when the engine answers "abort" (the trainer
            paused it to load new weights) the sample re-sends prompt + partial output with
            max_new_tokens reduced; each segment's tokens carry the label of the weights that
            produced them (version and trainer timeline; EngineView.generate), so a response may
            span several versions. An answer longer than `max_tokens_per_request` is continued the same way.
  group()   groupSize samples concurrently (the first failure cancels the others), scored (a
            reward that failed past its retries makes it an UnscoredGroup), and checked trainable
            (asyncrl.transport.content.check_group: finite logprobs, one per token, ...). What
            happens to the group (published, dropped, its lease released, its prompt queued again)
            is the executor's business (rollout/worker/worker.py), not the generator's.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from asyncrl.rollout.data.datasets import PromptItem
from asyncrl.rollout.generation.config import WorkerConfig, WorkerStats
from asyncrl.rollout.generation.engine_view import Dropped, EngineView, RequestBudget
from asyncrl.rollout.rewards.functions import RewardFailed, Scorer
from asyncrl.transport.content import check_group
from asyncrl.transport.streams import EPISODE_FAILED, REWARD_FAILED
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample


@dataclass
class Sample:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    timelines: list[int]
    finish: str


class InvalidGroup(Exception):
    """The group was generated but cannot be trained (check_group's reason): it is not published."""


class RefusedGroup(Exception):
    """The group cannot be trained for a reason its producer knows (never a made-up reward): it is not
    published but dead-lettered as `kind` with the reason. `group` holds what was generated (for the
    dead letter), the samples without a reward NaN."""

    kind = ""

    def __init__(self, message: str, group: TrajectoryGroup) -> None:
        super().__init__(message)
        self.group = group


class UnscoredGroup(RefusedGroup):
    """A sample's reward could not be computed (RewardFailed)."""

    kind = REWARD_FAILED


class FailedEpisodes(RefusedGroup):
    """An episode function failed on every try (rollout/episodes/runner.py)."""

    kind = EPISODE_FAILED


async def all_or_none(coros: list[Any]) -> list[Any]:
    """Like asyncio.gather, but the first failure cancels the others (an interrupted group's
    remaining samples must not go on generating, holding request slots, for nothing)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GroupGenerator:
    """Generates and scores groups on one engine; shared by every group of a worker."""

    def __init__(self, cfg: WorkerConfig, *, view: EngineView, decode: Callable[[list[int]], str],
                 stats: WorkerStats, stopping: asyncio.Event) -> None:
        self.cfg = cfg
        self.view = view
        self.decode = decode
        self.stats = stats
        self.stopping = stopping
        self.limits = cfg.group_limits()
        self.max_new_tokens = cfg.sampling.max_new_tokens
        """One answer's (or an episode turn's) budget: algorithm.maxNewTokens."""
        self._slots = asyncio.Semaphore(cfg.max_concurrent_requests)

    async def group(self, item: PromptItem, prompt_ids: list[int], scorer: Scorer, source: str = "") -> TrajectoryGroup:
        """The prompt's trainable group, scored by `scorer` and tagged with its `source` (a mixture's);
        raises Dropped (a sample failed past its budget), UnscoredGroup (a reward failed) or
        InvalidGroup (generated, but check_group refuses it)."""
        created = time.time()
        samples = await all_or_none([self.sample(prompt_ids) for _ in range(self.cfg.group_size)])
        scores = await scorer.score_all([self.decode(s.ids) for s in samples], item.answer, item.question,
                                        metadata=item.metadata)
        failures = [s for s in scores if isinstance(s, RewardFailed)]
        rewards = [math.nan if isinstance(s, RewardFailed) else s for s in scores]
        group = TrajectoryGroup(
            job=self.cfg.job, group_id=uuid.uuid4().hex, prompt_id=item.prompt_id,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            samples=[TrajectorySample(
                sample_index=i, response_ids=np.asarray(s.ids, dtype=np.int32),
                behav_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                versions=np.asarray(s.versions, dtype=np.int32), reward=float(r), finish_reason=s.finish,
                timelines=np.asarray(s.timelines, dtype=np.int32) if any(s.timelines) else None)
                for i, (s, r) in enumerate(zip(samples, rewards))],
            engine_id=self.cfg.engine_id, created_at=created, published_at=time.time(), source=source)
        if failures:
            raise UnscoredGroup(f"{len(failures)} of {len(samples)} rewards failed: {failures[0]}", group)
        problem = check_group(group, self.limits)
        if problem is not None:
            raise InvalidGroup(problem)
        return group

    async def sample(self, prompt_ids: list[int], budget: int | None = None) -> Sample:
        """One completion of at most `budget` tokens (default: maxNewTokens), continued across aborts
        (partial rollout), versions tagged per segment."""
        budget = self.max_new_tokens if budget is None else budget
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        tls: list[int] = []
        errors = RequestBudget()
        stalled = 0
        while True:
            remaining = budget - len(ids)
            if remaining <= 0:
                return Sample(ids, lps, vers, tls, "length")
            asked = min(remaining, self.cfg.max_tokens_per_request or remaining)
            result = await self.view.generate(prompt_ids + ids, replace(self.cfg.sampling, max_new_tokens=asked),
                                              errors, slots=self._slots)
            assert result.weight_version is not None  # (EngineView.generate: usable weights only)
            ids += result.output_ids
            lps += result.logprobs
            vers += [result.weight_version] * len(result.output_ids)
            tls += [result.weight_timeline] * len(result.output_ids)
            if result.finish_reason == "length" and asked < remaining and len(result.output_ids) == asked:
                self.stats.segments += 1  # the segment cap, not the answer's budget: continue it
                continue
            if result.finish_reason != "abort":
                return Sample(ids, lps, vers, tls, result.finish_reason)
            self.stats.interrupted += 1
            if self.stopping.is_set():
                raise asyncio.CancelledError
            stalled = 0 if result.output_ids else stalled + 1
            if stalled > self.cfg.max_retries + 5:  # aborted again and again with no progress
                raise Dropped(f"aborted {stalled} times in a row without progress", retry=True)
