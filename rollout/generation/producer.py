"""What turns a prompt into a training group or an evaluation answer, whatever the job's episode.

The rollout worker and the evaluator each hold one GroupProducer and never ask which kind it is:
single-turn (SingleTurn, here: one completion per sample) or the job's multi-turn episode
(rollout/episodes/runner.py EpisodeRunner, chosen by rollout/episodes/runner.py group_producer).
A model turn comes from a Turns: the worker's GroupGenerator (continued across aborts, each token
labelled with its weights) or an evaluation's engine (rollout/evaluation/run_pass.py EvalTurns).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncrl.rollout.data.datasets import PromptItem
from asyncrl.rollout.data.mixture import Lane
from asyncrl.rollout.generation.groups import GroupGenerator, Sample
from asyncrl.rollout.rewards.functions import Scorer
from asyncrl.transport.wire import TrajectoryGroup


class Turns(Protocol):
    """Where model turns come from."""

    max_new_tokens: int
    """One turn's budget (algorithm.maxNewTokens, or the evaluation's)."""

    async def sample(self, prompt_ids: list[int], budget: int | None = None) -> Sample: ...


@dataclass(frozen=True)
class Answer:
    """One evaluation answer: how many tokens it took (every turn's and observation's) and its reward."""

    length: int
    reward: float


class GroupProducer(Protocol):
    """Makes a prompt's training group (on the worker's generator) and its evaluation answers."""

    async def group(self, generator: GroupGenerator, item: PromptItem, lane: Lane) -> TrajectoryGroup:
        """The prompt's trainable group; raises what GroupGenerator.group raises (Dropped,
        UnscoredGroup, InvalidGroup) or another RefusedGroup."""
        ...

    async def answer(self, turns: Turns, item: PromptItem, render: Callable[[PromptItem], list[int]],
                     scorer: Scorer) -> Answer:
        """One scored answer to `item`, its turns from `turns` (which raises to cut it short)."""
        ...

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The JSON schemas of the tools the prompts offer (None: no tools)."""
        ...

    def close(self) -> None:
        """Release what the producer holds (tool sandboxes)."""
        ...


@dataclass(frozen=True)
class SingleTurn:
    """One completion per sample, scored as a whole (spec.rollout.episode: single-turn)."""

    decode: Callable[[list[int]], str]

    async def group(self, generator: GroupGenerator, item: PromptItem, lane: Lane) -> TrajectoryGroup:
        return await generator.group(item, lane.render(item), lane.scorer, lane.name)

    async def answer(self, turns: Turns, item: PromptItem, render: Callable[[PromptItem], list[int]],
                     scorer: Scorer) -> Answer:
        turn = await turns.sample(render(item))
        reward = await scorer.score(self.decode(turn.ids), item.answer, item.question, metadata=item.metadata)
        return Answer(len(turn.ids), reward)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return None

    def close(self) -> None:
        return None
