"""The worker's evaluator: serves the trainer's held-out evaluation requests on the worker's engine.

Only with `evaluation` (spec.evaluation), a side task of the worker: claims one request
(asyncrl.transport.evaluation; its own unfinished one first, then one a dead worker left, then a
new one), answers the held-out prompts on the same engine beside the training groups
(rollout.evaluation.evaluate: its own `max_concurrent_requests`, no admission lease, nothing
published to the trajectory stream, nothing trained), touches the request while it runs so no
other worker takes it over, and completes it with the EvalRecord. It is the episode's second
client of the engine view: answers are labelled like segments and engine errors retried like a
sample's (EngineView.generate). A failed pass is logged and left pending, retried after a backoff
(a backoff longer than `takeover_ms` lets another worker take it over). A stopping worker cancels
a running evaluation; its request stays pending.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.health import backoff_delay
from asyncrl.rollout.data.datasets import PromptItem
from asyncrl.rollout.engines.base import GenerateResult, SamplingParams
from asyncrl.rollout.evaluation.run_pass import EvalPart, EvalSettings, evaluate_parts
from asyncrl.rollout.generation.config import WorkerConfig, WorkerStats
from asyncrl.rollout.generation.engine_view import EngineView, RequestBudget
from asyncrl.rollout.generation.producer import GroupProducer
from asyncrl.rollout.rewards.functions import Scorer
from asyncrl.transport.connection import reraise_if_cancelled
from asyncrl.transport.evaluation import EvalChannel, EvalRequest

log = logging.getLogger("asyncrl.rollout.worker")


@dataclass
class WorkerEvaluation:
    """Held-out evaluation served by a worker (from spec.evaluation; no record = the worker serves none)."""

    parts: list[EvalPart]
    """The held-out prompts of each source, the same at every version (rollout.evaluation.load_eval_items),
    with the scorer of each (closed with the worker) and its prompt format (None: the worker's own)."""
    settings: EvalSettings
    block_ms: int = 2000
    """How long one claim waits for a new request (below the Redis client's socket timeout)."""
    takeover_ms: int = 60_000
    """A request untouched this long (its worker died) is taken over by another worker."""
    touch_s: float = 5.0
    """How often a running evaluation tells Redis it is alive (well below `takeover_ms`)."""
    retry_s: float = 5.0
    retry_max_s: float = 120.0
    """Base and cap of the backoff after a failed evaluation, before the request is tried again."""

    def __post_init__(self) -> None:
        if not self.parts or not all(part.items for part in self.parts):
            raise ValueError("evaluation needs held-out prompts; a part has no items")
        if not 0 < self.touch_s * 1000 < self.takeover_ms:
            raise ValueError(f"evaluation touch_s ({self.touch_s}) must be > 0 and below takeover_ms "
                             f"({self.takeover_ms}) / 1000, or a running evaluation is taken over")


@dataclass
class EvalProgress:
    """The running evaluation, for the progress line (`eval=v7 30/64`)."""

    version: int
    total: int
    done: int = 0

    def answered(self) -> None:
        self.done += 1


class _LabelledEngine:
    """The engine view as an evaluation sees it (rollout.evaluation.Generator): one error budget
    per answer, each answer labelled with the version of the weights that produced it."""

    def __init__(self, view: EngineView) -> None:
        self.view = view

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        return await self.view.generate(input_ids, params, RequestBudget())


async def _tagged_version(result: GenerateResult) -> int | None:
    """The version EngineView.generate put on an answer."""
    return result.weight_version


class Evaluator:
    """Serves evaluation requests one at a time, for as long as the worker runs."""

    def __init__(self, evaluation: WorkerEvaluation, cfg: WorkerConfig, *, redis: Any, names: StreamNames,
                 view: EngineView, render: Callable[[PromptItem], list[int]], decode: Callable[[list[int]], str],
                 stats: WorkerStats, producer: GroupProducer) -> None:
        self.evaluation = evaluation
        self.producer = producer
        """How an answer is made: the worker's (one completion, or the job's episode)."""
        self.cfg = cfg
        self.channel = EvalChannel(redis, names)
        self.engine = _LabelledEngine(view)
        self.render = render
        """The worker's prompt format: of parts without their own."""
        self.decode = decode
        self.stats = stats
        self.progress: EvalProgress | None = None
        """The evaluation running now (None: none)."""

    async def run(self, stopping: asyncio.Event) -> None:
        ev = self.evaluation
        redis_failures = failed = 0
        ready = False
        while not stopping.is_set():
            try:
                if not ready:
                    await self.channel.ensure_group()
                    ready = True
                request = await self.channel.claim(self.cfg.engine_id, block_ms=ev.block_ms,
                                                   min_idle_ms=ev.takeover_ms)
                redis_failures = 0
            except Exception as exc:  # Redis: retried like the version channel
                reraise_if_cancelled(exc)
                redis_failures += 1
                ready = False  # (the stream may have been deleted with its group)
                delay = backoff_delay(redis_failures, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s)
                log.warning("evaluation requests unavailable (retrying in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)
                continue
            if request is None:
                continue
            if await self.serve(request):
                failed = 0
                continue
            failed += 1
            await asyncio.sleep(backoff_delay(failed, base=ev.retry_s, cap=ev.retry_max_s))

    async def serve(self, request: EvalRequest) -> bool:
        """Evaluate `request.version` and complete the request; False: the pass failed, the request
        stays pending (tried again by this worker, or by another after `takeover_ms`)."""
        ev = self.evaluation
        prompts = sum(len(part.items) for part in ev.parts)
        progress = EvalProgress(request.version, prompts * ev.settings.samples_per_prompt)
        self.progress = progress
        done = asyncio.Event()
        fresh = asyncio.create_task(self._keep_fresh(request, done), name="evaluation-touch")
        log.info("evaluating version %d: %d prompts x %d answers", request.version, prompts,
                 ev.settings.samples_per_prompt)
        try:
            record = await evaluate_parts(self.engine, ev.parts, render=self.render, decode=self.decode,
                                          settings=ev.settings, version=request.version,
                                          version_of=_tagged_version, engine_id=self.cfg.engine_id,
                                          on_answer=progress.answered, producer=self.producer)
        except Exception as exc:  # EvaluationError, Dropped (engine failing past its budget), ...
            self.stats.evaluations_failed += 1
            log.warning("evaluation of version %d failed after %d/%d answers (left pending, tried again): "
                        "%s: %s", request.version, progress.done, progress.total, type(exc).__name__, exc)
            return False
        finally:
            done.set()  # (the loop's own check: a cancellation redis-py loses must not keep it touching)
            fresh.cancel()
            self.progress = None
        redis_failures = 0
        while True:  # the record is in hand: retry handing it in rather than evaluating again
            try:
                entry = await self.channel.complete(request, record)
                break
            except Exception as exc:
                reraise_if_cancelled(exc)
                redis_failures += 1
                delay = backoff_delay(redis_failures, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s)
                log.warning("could not hand in the evaluation of version %d (retrying in %.1fs): %s",
                            request.version, delay, exc)
                await asyncio.sleep(delay)
        self.stats.evaluations += 1
        pass_k = f" pass@{record.k}={record.pass_at_k:.3f}" if record.pass_at_k is not None else ""
        log.info("evaluated version %d: reward=%.3f pass@1=%.3f%s on_version=%.2f answers=%d seconds=%.1f%s",
                 record.policy_version, record.reward_mean, record.pass_at_1, pass_k, record.on_version,
                 record.samples, record.seconds,
                 "" if entry is not None else " (not published: another worker completed it first)")
        return True

    async def _keep_fresh(self, request: EvalRequest, done: asyncio.Event) -> None:
        """Touch the request while it is evaluated (until `done`), so no other worker takes it over.
        `done` ends it even when its cancellation is lost (redis-py on Python 3.11 can swallow one
        that lands as a command completes, CPython gh-86296): a touch loop outliving its evaluation
        would keep a stopped worker's request from every other worker."""
        while not done.is_set():
            await asyncio.sleep(self.evaluation.touch_s)
            if done.is_set():
                return
            try:
                await self.channel.touch(self.cfg.engine_id, request)
            except Exception as exc:
                reraise_if_cancelled(exc)
                log.warning("could not touch evaluation request %s: %s", request.entry_id, exc)

    def summary(self) -> str:
        """`evals=2 eval=v7 30/64 ` (the running one)."""
        s, running = self.stats, self.progress
        failed = f" eval_failed={s.evaluations_failed}" if s.evaluations_failed else ""
        now = f" eval=v{running.version} {running.done}/{running.total}" if running else ""
        return f"evals={s.evaluations}{failed}{now} "

    def close(self, training_scorers: Sequence[Scorer]) -> None:
        """Close the eval scorers, but the training ones (closed by the worker)."""
        own = {id(part.scorer): part.scorer for part in self.evaluation.parts}
        for scorer in own.values():
            if all(scorer is not s for s in training_scorers):
                scorer.close()
