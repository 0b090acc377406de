"""Where each prompt comes from: the job's one dataset, or a weighted mixture of sources (spec.datasets).

The worker's cursor hands out global positions (rollout/worker/prompt_cursor.py); a position decides the
source and the prompt on its own, so sharding, the shared cursor and resuming after a restart work
for a mixture exactly as for one dataset, and two workers never take the same prompt:
  the source   drawn by weight from a random stream seeded by (job seed, block of positions), so
               every worker and every restart sees the same draws;
  the prompt   the source's own position n: how many earlier global positions drew that source.
               Each source is walked in order (its own epochs and shuffles, datasets.py) and
               resumes where the mixture's low-water mark left it.
Changing the weights or the seed of a running job reshuffles which prompt each later position
takes (some prompts are then repeated or skipped); anything else about a source may change.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncrl.rollout.data.datasets import PromptItem, PromptSource
from asyncrl.rollout.rewards.functions import Scorer

BLOCK = 4096
"""Positions drawn from one seeded stream (the unit of caching)."""


class MixtureDraw:
    """Global position -> (source index, that source's position): the weighted, seeded draw."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {list(weights)}")
        total = float(sum(weights))
        self.cumulative = [c / total for c in itertools.accumulate(weights)]
        self.seed = seed
        self._starts: list[list[int]] = [[0] * len(weights)]
        """Per block b: how many positions before the block drew each source."""
        self._cached: tuple[int, list[int], list[int]] | None = None
        """(block, source per position, that source's rank within the block) of the newest block read."""

    def where(self, position: int) -> tuple[int, int]:
        """(source index, position within the source) of global `position`."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if len(self.cumulative) == 1:
            return 0, position
        block, offset = divmod(position, BLOCK)
        choices, ranks = self._block(block)
        source = choices[offset]
        return source, self._start(block)[source] + ranks[offset]

    def _draws(self, block: int) -> list[int]:
        rng = random.Random(f"mixture:{self.seed}:{block}")  # (str seeds: the same stream on every platform)
        last = len(self.cumulative) - 1
        return [min(bisect.bisect_right(self.cumulative, rng.random()), last) for _ in range(BLOCK)]

    def _block(self, block: int) -> tuple[list[int], list[int]]:
        if self._cached is None or self._cached[0] != block:
            choices = self._draws(block)
            seen = [0] * len(self.cumulative)
            ranks = []
            for source in choices:
                ranks.append(seen[source])
                seen[source] += 1
            self._cached = (block, choices, ranks)
        return self._cached[1], self._cached[2]

    def _start(self, block: int) -> list[int]:
        while len(self._starts) <= block:  # (once per block ever: a resume far in walks the blocks before it)
            b = len(self._starts) - 1
            counts = list(self._starts[b])
            for source in self._draws(b):
                counts[source] += 1
            self._starts.append(counts)
        return self._starts[block]


@dataclass(frozen=True)
class Lane:
    """One source of prompts with how its prompts are rendered and its answers scored."""

    name: str
    """The source's name in the figures; "" for a job's only dataset (its groups carry no source)."""
    source: PromptSource
    render: Callable[[PromptItem], list[int]]
    """prompt -> token ids (the source's template and system prompt, the chat template)."""
    scorer: Scorer


@dataclass
class Mixture:
    """The worker's prompts: lanes drawn by weight (one lane: every position is its own)."""

    lanes: list[Lane]
    weights: list[float]
    seed: int = 0
    draw: MixtureDraw = field(init=False)

    def __post_init__(self) -> None:
        if len(self.lanes) != len(self.weights):
            raise ValueError(f"{len(self.lanes)} sources but {len(self.weights)} weights")
        self.draw = MixtureDraw(self.weights, self.seed)

    @classmethod
    def single(cls, source: PromptSource, render: Callable[[PromptItem], list[int]], scorer: Scorer) -> Mixture:
        """The job's one dataset."""
        return cls([Lane("", source, render, scorer)], [1.0])

    def pick(self, position: int) -> tuple[Lane, PromptItem]:
        """The lane and prompt of global `position`."""
        index, local = self.draw.where(position)
        lane = self.lanes[index]
        return lane, lane.source.item(local)

    def scorers(self) -> list[Scorer]:
        """Each distinct scorer once (sources without a reward of their own share the job's)."""
        return list({id(lane.scorer): lane.scorer for lane in self.lanes}.values())
