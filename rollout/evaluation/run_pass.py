"""One held-out evaluation pass: fixed prompts, k answers each, scored, summarised per version.

Shared by the rollout worker (evaluations requested by the trainer during training, served by
the engine between training groups) and `asyncrl eval` (any model directory, on an in-process
engine). Nothing here is trained: answers carry no logprobs that matter and never reach Redis.

Version discipline: an answer must come wholly from one set of weights. When a weight update
cuts an answer short (the engine answers "abort"), the answer is generated again from the start,
now on the newer weights; `EvalRecord.on_version` is the fraction of answers that the requested
version produced, so a pass that straddled an update says so instead of blending silently.

An answer is correct when its reward is >= 1 (the built-in rewards are 0/1); pass@k uses the
unbiased estimator of Chen et al. (2021) with n = k answers per prompt, i.e. "any correct".

A job with a multi-turn episode (spec.rollout.episode) is evaluated on the same episode: an
"answer" is a whole episode run with the evaluation's sampling, its reward the episode's, its
length every token after the prompt; a weight update that cuts any of its turns short starts the
episode again, so an episode too comes wholly from one set of weights.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from asyncrl.api.spec import AlgorithmSpec, DatasetSpec, EvalDatasetSpec, EvaluationSpec
from asyncrl.api.status_report import EvalRecord
from asyncrl.rollout.data.datasets import ListSource, PromptItem, PromptSource, load_source
from asyncrl.rollout.engines.base import GenerateResult, SamplingParams
from asyncrl.rollout.generation.groups import Sample
from asyncrl.rollout.generation.producer import GroupProducer, SingleTurn
from asyncrl.rollout.rewards.functions import Scorer

CORRECT_REWARD = 1.0
MAX_ABORTS = 20
"""Restarts of one answer (each after a weight update cut it short) before the pass fails."""

VersionOf = Callable[[GenerateResult], Awaitable[int | None]]
"""The weight version that produced an answer (None: unknown)."""


class Generator(Protocol):
    """What an evaluation needs of an engine (an Engine, or the rollout worker's retrying wrapper)."""

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult: ...


class EvaluationError(RuntimeError):
    """An evaluation pass that could not finish (the engine kept failing or aborting)."""


@dataclass(frozen=True)
class EvalSettings:
    """How to answer: k answers per prompt, the sampling of each, requests in flight."""

    samples_per_prompt: int
    sampling: SamplingParams
    max_concurrent_requests: int = 8

    @classmethod
    def from_spec(cls, spec: EvaluationSpec, algorithm: AlgorithmSpec,
                  stop_token_ids: tuple[int, ...] = ()) -> EvalSettings:
        sampling = SamplingParams(max_new_tokens=spec.max_new_tokens or algorithm.max_new_tokens,
                                  temperature=spec.temperature, stop_token_ids=stop_token_ids)
        return cls(spec.samples_per_prompt, sampling, spec.max_concurrent_requests)


def eval_prompt_format(dataset: EvalDatasetSpec, training: DatasetSpec) -> tuple[str | None, str | None]:
    """(prompt template, system prompt) of an eval source's prompts: its own, else its training
    dataset's (the format the model is being trained to answer in)."""
    return (dataset.prompt_template or training.prompt_template, dataset.system_prompt or training.system_prompt)


def eval_sources(spec: EvaluationSpec) -> list[tuple[str, EvalDatasetSpec]]:
    """(name, dataset) of each source of held-out prompts: ("", dataset) for evaluation.dataset."""
    if spec.datasets is not None:
        return [(d.name, d) for d in spec.datasets]
    assert spec.dataset is not None  # (EvaluationSpec: one of dataset and datasets)
    return [("", spec.dataset)]


@dataclass(frozen=True)
class EvalPart:
    """One source of held-out prompts, rendered and scored its own way; a pass answers every part
    and reports the figures over all of them, and each part's (`merge_records`)."""

    name: str
    """The source's name in `pass_at_1_by_source`; "" for the evaluation's one dataset."""
    items: list[PromptItem]
    scorer: Scorer
    render: Callable[[PromptItem], list[int]] | None = None
    """None: the caller's (the training format)."""


def eval_items(source: PromptSource, prompts: int) -> list[PromptItem]:
    """The first `prompts` distinct questions (chats) of the source (all of a smaller finite one):
    the same prompts at every version, so the figures compare."""
    items: dict[tuple[str, str], PromptItem] = {}
    position, limit = 0, len(source)
    while len(items) < prompts and position < min(limit, prompts * 100):
        item = source.item(position)
        items.setdefault((item.question, repr(item.messages)), item)  # (chats ending alike differ)
        position += 1
    return list(items.values())


def load_eval_items(dataset: EvalDatasetSpec, prompts: int) -> list[PromptItem]:
    source = load_source(dataset)
    if isinstance(source, ListSource):  # a seeded shuffle of a finite file: a fair sample of it
        source = ListSource(source.items, seed=dataset.seed)
    return eval_items(source, prompts)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k answers drawn from n (c of them correct) is correct."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def summarize(version: int, rewards: list[list[float]], *, lengths: list[int], on_version: float,
              seconds: float, engine_id: str = "") -> EvalRecord:
    """The record of one pass from each prompt's rewards (k per prompt)."""
    if not rewards or any(len(r) != len(rewards[0]) or not r for r in rewards):
        raise ValueError("every prompt needs the same, non-zero number of answers")
    k = len(rewards[0])
    flat = [x for r in rewards for x in r]
    correct = [sum(x >= CORRECT_REWARD for x in r) for r in rewards]
    return EvalRecord(
        policy_version=version, reward_mean=sum(flat) / len(flat),
        pass_at_1=sum(pass_at_k(k, c, 1) for c in correct) / len(rewards),
        pass_at_k=sum(pass_at_k(k, c, k) for c in correct) / len(rewards) if k > 1 else None,
        k=k, prompts=len(rewards), samples=len(flat), on_version=on_version,
        response_length=sum(lengths) / len(lengths) if lengths else 0.0, seconds=seconds,
        engine_id=engine_id, time=time.time())


def merge_records(records: dict[str, EvalRecord]) -> EvalRecord:
    """One pass's record from its parts' (`EvalPart`): the figures over every prompt and answer of
    every part, and each named part's pass@1 and reward in `*_by_source`. One unnamed part: its own."""
    if list(records) == [""]:
        return records[""]
    parts = list(records.values())
    prompts, samples = sum(r.prompts for r in parts), sum(r.samples for r in parts)

    def per_prompt(figure: Callable[[EvalRecord], float]) -> float:
        return sum(figure(r) * r.prompts for r in parts) / prompts

    def per_answer(figure: Callable[[EvalRecord], float]) -> float:
        return sum(figure(r) * r.samples for r in parts) / samples

    first = parts[0]
    return first.model_copy(update={
        "reward_mean": per_answer(lambda r: r.reward_mean), "pass_at_1": per_prompt(lambda r: r.pass_at_1),
        "pass_at_k": None if first.pass_at_k is None else per_prompt(lambda r: r.pass_at_k or 0.0),
        "prompts": prompts, "samples": samples, "on_version": per_answer(lambda r: r.on_version),
        "response_length": per_answer(lambda r: r.response_length), "seconds": sum(r.seconds for r in parts),
        "time": max(r.time for r in parts),
        "reward_by_source": {name: r.reward_mean for name, r in records.items()},
        "pass_at_1_by_source": {name: r.pass_at_1 for name, r in records.items()}})


async def evaluate_parts(engine: Generator, parts: list[EvalPart], *, render: Callable[[PromptItem], list[int]],
                         decode: Callable[[list[int]], str], settings: EvalSettings, version: int = 0,
                         version_of: VersionOf | None = None, engine_id: str = "",
                         on_answer: Callable[[], None] | None = None,
                         producer: GroupProducer | None = None) -> EvalRecord:
    """`evaluate` each part in turn (each within the settings' request bound) and merge the records;
    `render` is the default of a part without its own."""
    records = {}
    for part in parts:
        records[part.name] = await evaluate(engine, part.items, render=part.render or render, decode=decode,
                                            scorer=part.scorer, settings=settings, version=version,
                                            version_of=version_of or _labelled, engine_id=engine_id,
                                            on_answer=on_answer, producer=producer)
    return merge_records(records)


async def _labelled(result: GenerateResult) -> int | None:
    return result.weight_version


class Aborted(Exception):
    """A turn of an evaluation answer was cut short by a weight update."""


class EvalTurns:
    """An evaluation answer's model turns: one request each with the evaluation's sampling, no
    continuation across an abort (Aborted: the answer starts again); records who produced each."""

    def __init__(self, engine: Generator, settings: EvalSettings, slots: asyncio.Semaphore,
                 version_of: VersionOf) -> None:
        self.engine, self.settings, self.slots, self.version_of = engine, settings, slots, version_of
        self.max_new_tokens = settings.sampling.max_new_tokens
        self.produced_by: list[int | None] = []

    async def sample(self, prompt_ids: list[int], budget: int | None = None) -> Sample:
        params = replace(self.settings.sampling, max_new_tokens=budget or self.max_new_tokens)
        async with self.slots:
            result = await self.engine.generate(prompt_ids, params)
        if result.finish_reason == "abort":
            raise Aborted
        self.produced_by.append(await self.version_of(result))
        n = len(result.output_ids)
        return Sample(result.output_ids, result.logprobs, [0] * n, [0] * n, result.finish_reason)


async def evaluate(engine: Generator, items: list[PromptItem], *, render: Callable[[PromptItem], list[int]],
                   decode: Callable[[list[int]], str], scorer: Scorer, settings: EvalSettings,
                   version: int = 0, version_of: VersionOf = _labelled, engine_id: str = "",
                   on_answer: Callable[[], None] | None = None, producer: GroupProducer | None = None) -> EvalRecord:
    """Answer every item `samples_per_prompt` times on `engine` and summarise as `version`'s pass,
    each answer made by `producer` (default: one completion; the job's episode for a multi-turn job).

    `version_of` names the weights behind an answer (default: the engine's label; an engine
    without labels and no registry, e.g. `asyncrl eval`'s own, answers None = `version`).
    `on_answer` is called after each scored answer (progress bars)."""
    if not items:
        raise EvaluationError("no held-out prompts to evaluate")
    slots = asyncio.Semaphore(settings.max_concurrent_requests)
    producer = producer or SingleTurn(decode)
    started = time.monotonic()
    lengths: list[int] = []
    on: list[bool] = []

    async def answer(item: PromptItem) -> float:
        for _ in range(MAX_ABORTS + 1):
            turns = EvalTurns(engine, settings, slots, version_of)
            try:
                made = await producer.answer(turns, item, render, scorer)
            except Aborted:  # a turn cut short by a weight update: start the answer again
                continue
            on.append(all(v is None or v == version for v in turns.produced_by))
            lengths.append(made.length)
            if on_answer is not None:
                on_answer()
            return made.reward
        raise EvaluationError(f"prompt {item.prompt_id}: aborted {MAX_ABORTS + 1} times in a row")

    # One flat set of tasks: when an answer fails, every other one is cancelled, not left generating.
    k = settings.samples_per_prompt
    answers = [asyncio.ensure_future(answer(item)) for item in items for _ in range(k)]
    try:
        flat = await asyncio.gather(*answers)
    finally:
        for task in answers:
            task.cancel()
        await asyncio.gather(*answers, return_exceptions=True)
    rewards = [list(flat[i:i + k]) for i in range(0, len(flat), k)]
    return summarize(version, rewards, lengths=lengths, on_version=sum(on) / len(on),
                     seconds=time.monotonic() - started, engine_id=engine_id)
