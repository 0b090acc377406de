"""The rollout worker: prompts in, version-tagged trajectory groups out, never waiting for training.

Read top to bottom:
  run()           takes an admission lease per group (blocks when the global staleness budget is
                  spent: the worker does not buffer), picks the next prompt of its shard, starts
                  the group as a task; a version follower, a registry heartbeat and (with
                  `evaluation`) the evaluator run beside it.
  _run_group()    samples n completions concurrently, scores them, checks the group can be trained
                  (asyncrl.transport.content.check_group: finite logprobs, one per token, ...),
                  publishes the whole group with one XADD, releases the lease as accepted. A group
                  whose sample keeps failing, or that fails the check, is dropped (lease released
                  unaccepted, counted, logged with the reason; its prompt is not retried), never
                  published: a poison group would only be dead-lettered by the trainer. A group
                  interrupted by its engine going away (unreachable past `engine_outage_s`, or
                  aborted again and again) is not the prompt's fault: its prompt is queued again
                  and generated anew (counted as `requeued`), never marked done unanswered.
  _sample()       one completion as a sequence of segments: when the engine answers "abort" (the
                  trainer paused it to load new weights) the worker re-sends prompt + partial
                  output with max_new_tokens reduced; each segment's tokens carry the version of
                  the weights that produced them, so a response may span several versions. An
                  engine that cannot be reached (restarting, rescheduled) is waited for, with
                  capped exponential backoff and jitter, for `engine_outage_s`: a transient
                  outage delays the group instead of dropping it.
  _segment_version() where that version comes from: the label the engine puts on its answer
                  (SGLang, vLLM 0.32, our hf server; "default" is the base model, version 0, see
                  engines.base.label_version), or, for an engine without one, the trainer's
                  record for this engine in the EngineRegistry, read before and after the segment,
                  if that record describes the engine's current incarnation. Never a guess: a
                  segment whose version cannot be named is discarded and generated again.
  _wait_for_weights() the gate before every lease and segment: the worker generates only on an
                  engine whose version is known and within the admission bound (policy version -
                  engine version <= eta). A restarted engine (serving the base model, or weights
                  nobody can name) is not used until the trainer's catch-up has loaded the current
                  version into it (trainer/weight_sync.py); meanwhile the worker is Degraded
                  (`degraded=engine-weights(...)`, logged) and counts the waits (`weight_waits`).
  _evaluator()    (only with `evaluation`, spec.evaluation) a side task serving the trainer's held-out
                  evaluation requests (asyncrl.transport.evaluation): claims one (its own unfinished
                  one first, then one a dead worker left, then a new one), answers the held-out
                  prompts on the same engine beside the training groups (rollout.evaluation.evaluate:
                  its own `max_concurrent_requests`, no admission lease, nothing published to the
                  trajectory stream, nothing trained), touches the request while it runs so no
                  other worker takes it over, and completes it with the EvalRecord. Answers are
                  labelled like segments (_segment_version); engine errors are retried like a
                  sample's. A failed pass is logged and left pending, retried after a backoff (a
                  backoff longer than `takeover_ms` lets another worker take it over).
The worker never pauses, updates or resumes its engine: the trainer alone does that, for every
engine (trainer/weight_sync.py). The worker observes: the version channel (the policy version),
its engine's weight version and label as the server reports them, and the server's incarnation
(registered with each heartbeat). The incarnation is the server's own id when it reports one (our
hf server), else minted here: anew at worker start, and whenever the server may have restarted
(its label went back to "default" from a trained version, or it could not be reached and answers
again). A false alarm costs one reload by the trainer; a missed restart cannot mislabel answers
that carry their label, and for an engine without labels is ruled out by the reconnect rule.
Shutdown (SIGTERM/stop()): stop taking leases, cancel in-flight groups, release their leases
unaccepted, cancel a running evaluation (its request stays pending: this worker after a restart,
or another one after `takeover_ms`, serves it), remove the engine from the registry. The wait for
a lease and the side tasks are cancelled again until they end (cancel_and_wait: Python 3.11 can
lose a cancellation in the Redis client, which left a stopping worker polling for a lease forever).
Outages: Redis commands block through an outage of up to the client's window (the client's retry
policy, asyncrl/transport/connection.py), engine requests through `engine_outage_s`; meanwhile the
worker is Degraded: the outage is logged when it starts, while it lasts and when it ends, and the
progress line says `degraded=redis(12s)` (asyncrl.health.HEALTH).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import numpy as np

from asyncrl.health import HEALTH, Health, backoff_delay
from asyncrl.rollout.datasets import PromptItem, PromptSource, ShardCursor
from asyncrl.rollout.engines.base import (
    LAUNCH_LABEL,
    Engine,
    EngineError,
    GenerateResult,
    SamplingParams,
    label_version,
)
from asyncrl.rollout.evaluation import EvalSettings, evaluate
from asyncrl.rollout.rewards import RewardScorer
from asyncrl.transport.admission import Admission
from asyncrl.transport.content import GroupLimits, check_group
from asyncrl.transport.evaluation import EvalChannel, EvalRequest
from asyncrl.transport.names import StreamNames
from asyncrl.transport.streams import TrajectoryProducer
from asyncrl.transport.versions import EngineInfo, EngineRegistry, EngineWeights, VersionChannel
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

log = logging.getLogger("asyncrl.rollout.worker")

SIDE_TASK_STOP_S = 10.0
"""How long a stopping worker waits for its heartbeat, progress, version-following and evaluator tasks."""

CANCEL_AGAIN_S = 1.0
"""How often a stopping worker repeats the cancellation of a task that has not ended (see cancel_and_wait)."""
WEIGHTS_POLL_S = 0.5
"""How often a worker waiting for usable weights (_wait_for_weights) looks at its engine again."""
UPDATE_POLL_S = 0.05
"""How often a segment for an engine without weight labels re-reads the trainer's record while the
trainer is updating that engine."""
DEFAULT_ENGINE_OUTAGE_S = 180.0
"""How long a request waits for an unreachable engine before its group is dropped (a restarting
SGLang server reloads its model in well under this)."""
_OUTAGE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                  httpx.RemoteProtocolError)
_OUTAGE_STATUS = frozenset({502, 503, 504})


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout: float | None = None) -> set[asyncio.Task]:
    """Cancel `tasks` and wait until they end (or `timeout` s); returns those still running.

    The cancellation is repeated every CANCEL_AGAIN_S: on Python 3.11, asyncio.wait_for, which
    redis-py sends every command through, loses a cancellation that arrives just as the command
    completes (CPython gh-86296), and a polling loop such as Admission.acquire then runs on forever."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        wait = CANCEL_AGAIN_S if deadline is None else min(CANCEL_AGAIN_S, deadline - time.monotonic())
        if wait <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=wait)
    return pending


async def _all_or_none(coros: list[Any]) -> list[Any]:
    """Like asyncio.gather, but the first failure cancels the others (an interrupted group's
    remaining samples must not go on generating, holding request slots, for nothing)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_unreachable(exc: BaseException) -> bool:
    """Whether an engine error means the server is not there right now (refused, reset, gone
    mid-answer, or a proxy saying so), as opposed to a server that answered with an error: the
    first is waited out, the second is retried `max_retries` times and then drops the group."""
    if not isinstance(exc, EngineError):
        return False
    return isinstance(exc.__cause__, _OUTAGE_ERRORS) or exc.status in _OUTAGE_STATUS


@dataclass
class WorkerConfig:
    """What one worker process needs, resolved once by rollout/main.py from the spec and the pod.

    Not the spec itself, on purpose: most fields are per-process facts the spec cannot know (the
    engine id and URL from the pod, the shard, retry and heartbeat timings), and the three that
    come from the spec are already derived (`sampling` carries the tokenizer's stop ids). Tests and
    benchmarks build a worker without a job file from this record alone.
    """

    job: str
    engine_id: str
    group_size: int
    sampling: SamplingParams
    engine_url: str = ""
    """The URL the trainer uses to reach this worker's engine (registered in EngineRegistry)."""
    max_concurrent_requests: int = 64
    max_tokens_per_request: int | None = None
    """Segment cap (spec.rollout.maxTokensPerRequest): longer answers take consecutive requests."""
    max_retries: int = 3
    """Engine errors tolerated per sample before the group is dropped (an unreachable engine is
    waited for instead, see `engine_outage_s`)."""
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    """Base and cap of the exponential backoff between retries (jittered for outages)."""
    engine_outage_s: float = DEFAULT_ENGINE_OUTAGE_S
    """How long a sample waits for an unreachable engine (engine_unreachable) before the group is
    dropped; the worker is Degraded meanwhile."""
    heartbeat_s: float = 5.0
    log_every_s: float = 10.0
    max_groups: int | None = None
    """Stop after starting this many groups (tests, benchmarks); None = run until stopped."""
    rollout_index: int = 0
    rollout_replicas: int = 1
    """Number of fixed shards; 0 = one job-wide cursor shared by any number of workers (a
    Kubernetes Deployment's pods have no stable index, and scaling must not restart them)."""
    vocab_size: int | None = None
    """The model's vocabulary, when known: token ids at or above it make a group unpublishable."""

    def group_limits(self) -> GroupLimits:
        """What a publishable group must respect beyond the wire format (see check_group)."""
        return GroupLimits(vocab_size=self.vocab_size, group_size=self.group_size,
                           max_response_tokens=self.sampling.max_new_tokens)


@dataclass
class WorkerEvaluation:
    """Held-out evaluation served by a worker (from spec.evaluation; no record = the worker serves none)."""

    items: list[PromptItem]
    """The held-out prompts, the same at every version (rollout.evaluation.load_eval_items)."""
    settings: EvalSettings
    scorer: RewardScorer
    """Scores eval answers (evaluation.reward, else the job's reward); closed with the worker."""
    render: Callable[[str], list[int]] | None = None
    """question -> prompt ids for eval prompts (rollout.evaluation.eval_prompt_format); None = the
    worker's own (the training format)."""
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
        if not self.items:
            raise ValueError("evaluation needs held-out prompts; items is empty")
        if not 0 < self.touch_s * 1000 < self.takeover_ms:
            raise ValueError(f"evaluation touch_s ({self.touch_s}) must be > 0 and below takeover_ms "
                             f"({self.takeover_ms}) / 1000, or a running evaluation is taken over")


@dataclass
class _EvalProgress:
    """The running evaluation, for the progress line (`eval=v7 30/64`)."""

    version: int
    total: int
    done: int = 0

    def answered(self) -> None:
        self.done += 1


@dataclass
class WorkerStats:
    groups_published: int = 0
    groups_dropped: int = 0
    """Groups not published: a sample failed past its retries, or the group failed check_group."""
    groups_invalid: int = 0
    """Of `groups_dropped`: generated but untrainable (e.g. a NaN logprob from the engine)."""
    samples: int = 0
    tokens: int = 0
    requests: int = 0
    request_errors: int = 0
    interrupted: int = 0
    """Segments that ended in "abort" and were continued (partial rollouts)."""
    segments: int = 0
    """Segments that reached `max_tokens_per_request` and were continued (long answers)."""
    held: int = 0
    """Segments held back while the trainer updated an engine without weight labels."""
    discarded: int = 0
    """Segments of such an engine generated again: an update ran beside them and which weights
    produced them is unknown (rare: needs an update to begin while the segment's answer is on its way)."""
    evaluations: int = 0
    """Evaluation requests completed (results handed to the trainer)."""
    evaluations_failed: int = 0
    """Evaluation passes that failed (their request was left pending and tried again)."""
    requeued: int = 0
    """Groups interrupted by their engine going away: their prompt was queued again, not dropped."""
    weight_waits: int = 0
    """Times the worker stopped generating because its engine's weights were unknown or beyond
    the admission bound (a restarted engine), until the trainer's catch-up loaded current ones."""
    restarts_seen: int = 0
    """Engine incarnations after the first one (restarts seen, or suspected)."""
    started: float = field(default_factory=time.monotonic)

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)


@dataclass
class _Sample:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str


class _Dropped(Exception):
    """A sample failed past its retry budget: the group is dropped (`retry`: its prompt is queued
    again, as the failure was the engine's, not the prompt's)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class _RegistryUnavailable(Exception):
    """The trainer's record of an unlabelled engine could not be read (retried like an engine error)."""


@dataclass
class _Tries:
    """One request's error budget so far (see RolloutWorker._after_error)."""

    failures: int = 0
    unreachable_since: float | None = None
    waits: int = 0


class _EvalEngine:
    """The worker's engine as an evaluation sees it (rollout.evaluation.Generator): errors retried
    like a sample's, each answer labelled with the version of the weights that produced it."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        return await self.worker._eval_generate(input_ids, params)


async def _tagged_version(result: GenerateResult) -> int | None:
    """The version _eval_generate put on an answer."""
    return result.weight_version


def cursor_key(names: StreamNames, index: int, replicas: int) -> str:
    """Redis key of a shard's resumable cursor (same hash tag as the job's other keys)."""
    shard = "shared" if replicas == 0 else f"{index}-of-{replicas}"
    return names.rollout_cursor(shard)


class RolloutWorker:
    def __init__(self, cfg: WorkerConfig, *, engine: Engine, redis: Any, source: PromptSource,
                 render: Any, decode: Any, scorer: RewardScorer, admission: Admission,
                 names: StreamNames | None = None, health: Health = HEALTH,
                 evaluation: WorkerEvaluation | None = None):
        self.cfg = cfg
        self.health = health
        """Where outages are recorded (the process's board: the Redis client reports to it too)."""
        self.engine = engine
        self.redis = redis
        self.source = source
        self.render = render
        self.decode = decode
        self.scorer = scorer
        self.admission = admission
        self.evaluation = evaluation
        """Held-out evaluation to serve (read when run() starts); None: none."""
        self.names = names or StreamNames.for_job(cfg.job)
        self.producer = TrajectoryProducer(redis, self.names)
        self.versions = VersionChannel(redis, self.names)
        self.registry = EngineRegistry(redis, self.names)
        self.shared_cursor = cfg.rollout_replicas == 0
        self.cursor = ShardCursor(cfg.rollout_index, max(1, cfg.rollout_replicas))
        self.cursor_key = cursor_key(self.names, cfg.rollout_index, cfg.rollout_replicas)
        self.stats = WorkerStats()
        self.limits = cfg.group_limits()
        self.version = 0
        """The newest policy version on the version channel (observed; the worker updates nothing)."""
        self.engine_version: int | None = None
        """The engine's weight version as last observed (its label, or the trainer's record); None: unknown."""
        self.engine_label: str | None = None
        """The engine's weight label exactly as the server last reported it (None: it reports none)."""
        self.incarnation = uuid.uuid4().hex
        """The engine server's life as far as this worker knows (see the module docstring)."""
        self._engine_lost = False
        """The engine could not be reached since the last observation: it may have restarted."""
        self._named_incarnation = False
        """Whether `incarnation` is the server's own id (our hf server), not one minted here."""
        self._weights_lock = asyncio.Lock()
        self._requeued: list[tuple[int, int]] = []
        """(local index, dataset position) of interrupted groups, taken again before new prompts."""
        self.labelled = engine.reports_weight_version
        self._slots = asyncio.Semaphore(cfg.max_concurrent_requests)
        self._group_slots = asyncio.Semaphore(max(1, math.ceil(cfg.max_concurrent_requests / cfg.group_size)))
        self._stop = asyncio.Event()
        self._groups: set[asyncio.Task] = set()
        self._saves: set[asyncio.Future] = set()
        self._done_locals: set[int] = set()
        self._low_water = 0
        self._saved_low_water = -1  # (the last value written: -1, none yet)
        self._cursor_lock = asyncio.Lock()
        self._eval_progress: _EvalProgress | None = None

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): stop taking leases, release in-flight groups."""
        self._stop.set()

    async def _return_leases(self) -> None:
        """Release the leases a killed predecessor of the same name still holds (admission.py): its
        groups died with it, and waiting for the leases to expire would hold their slots meanwhile."""
        returned = await self.admission.release_holder(self.cfg.engine_id)
        if returned:
            log.warning("returned %d admission lease(s) held by a previous worker %s", returned, self.cfg.engine_id)

    async def run(self) -> WorkerStats:
        await self._return_leases()
        await self._restore_cursor()
        await self._initial_version()
        side = [asyncio.create_task(self._heartbeat(), name="heartbeat"),
                asyncio.create_task(self._log_progress(), name="progress"),
                asyncio.create_task(self._follow_versions(), name="versions")]
        if self.evaluation is not None:
            side.append(asyncio.create_task(self._evaluator(), name="evaluator"))
        started = 0
        try:
            while not self._stop.is_set() and (self.cfg.max_groups is None or started < self.cfg.max_groups):
                if not await self._wait_or_stop(self._group_slots.acquire()):
                    break
                if not await self._wait_or_stop(self._weights_before_lease()):
                    self._group_slots.release()
                    break
                lease = await self._wait_or_stop(self.admission.acquire(self.cfg.engine_id))
                if lease is None:
                    self._group_slots.release()
                    break
                again = bool(self._requeued)  # (an interrupted group's prompt: not a new start)
                local, position = await self._take_position()
                task = asyncio.create_task(self._run_group(lease, local, position), name=f"group-{local}")
                self._groups.add(task)
                task.add_done_callback(self._groups.discard)
                started += 0 if again else 1
            while not self._stop.is_set() and self._groups:  # (an interrupted one may be queued again)
                await self._wait_or_stop(asyncio.gather(*list(self._groups), return_exceptions=True))
                if self._requeued and not self._stop.is_set():
                    await self._run_requeued()
        finally:
            for task in list(self._groups):
                task.cancel()
            if self._groups:
                await asyncio.gather(*list(self._groups), return_exceptions=True)
            # bounded: a helper stuck in a client that swallowed its cancellation must not hold the
            # shutdown (and the cursor save below) for a whole outage window
            stuck = await cancel_and_wait(side, timeout=SIDE_TASK_STOP_S)
            if stuck:
                log.warning("stopping without waiting for %s (did not stop within %.0fs)",
                            ", ".join(t.get_name() for t in stuck), SIDE_TASK_STOP_S)
            await self._save_cursor()
            try:
                await self.registry.remove(self.cfg.engine_id)
            except Exception as exc:  # Redis gone during shutdown: nothing left to clean
                log.warning("could not remove engine %s from the registry: %s", self.cfg.engine_id, exc)
            self.scorer.close()
            if self.evaluation is not None and self.evaluation.scorer is not self.scorer:
                self.evaluation.scorer.close()
            log.info("rollout worker stopped: %s", self.summary())
        return self.stats

    async def _run_requeued(self) -> None:
        """After the last new group (max_groups): start the interrupted groups' prompts again."""
        while self._requeued and not self._stop.is_set():
            if not await self._wait_or_stop(self._group_slots.acquire()):
                return
            lease = await self._wait_or_stop(self.admission.acquire(self.cfg.engine_id))
            if lease is None:
                self._group_slots.release()
                return
            local, position = self._requeued.pop(0)
            task = asyncio.create_task(self._run_group(lease, local, position), name=f"group-{local}")
            self._groups.add(task)
            task.add_done_callback(self._groups.discard)

    async def _wait_or_stop(self, aw: Any) -> Any:
        """Await `aw` unless stop() is called first (then cancel it and return None)."""
        task = asyncio.ensure_future(aw)
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if task in done:
            return task.result()
        await cancel_and_wait({task})
        if task.done() and not task.cancelled() and task.exception() is None:
            # it finished while being cancelled: hand back what it acquired
            result = task.result()
            if isinstance(result, str):
                await self.admission.release(result, accepted=False)
            elif result is True:
                self._group_slots.release()
        return None

    # ------------------------------------------------------------------ one group

    async def _run_group(self, lease: str, local: int, position: int) -> None:
        published = requeued = False
        renew = asyncio.create_task(self._renew(lease))
        try:
            item = self.source.item(position)
            prompt_ids = self.render(item.question)
            created = time.time()
            try:
                samples = await _all_or_none([self._sample(prompt_ids) for _ in range(self.cfg.group_size)])
            except _Dropped as exc:
                if exc.retry:
                    requeued = True
                    self.stats.requeued += 1
                    self._requeued.append((local, position))
                    log.warning("group for prompt %s interrupted, its prompt is queued again: %s", item.prompt_id, exc)
                    return
                self.stats.groups_dropped += 1
                log.warning("dropped group for prompt %s: %s", item.prompt_id, exc)
                return
            rewards = await asyncio.gather(*[self.scorer.score(self.decode(s.ids), item.answer) for s in samples])
            group = TrajectoryGroup(
                job=self.cfg.job, group_id=uuid.uuid4().hex, prompt_id=item.prompt_id,
                prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                samples=[TrajectorySample(
                    sample_index=i, response_ids=np.asarray(s.ids, dtype=np.int32),
                    behav_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    versions=np.asarray(s.versions, dtype=np.int32), reward=float(r), finish_reason=s.finish)
                    for i, (s, r) in enumerate(zip(samples, rewards))],
                engine_id=self.cfg.engine_id, created_at=created, published_at=time.time())
            problem = check_group(group, self.limits)
            if problem is not None:  # dropped like a failed generation: the trainer could not train it
                self.stats.groups_dropped += 1
                self.stats.groups_invalid += 1
                log.warning("dropped group for prompt %s (not published): %s", item.prompt_id, problem)
                return
            await self.producer.publish(group)
            published = True
            self.stats.groups_published += 1
            self.stats.samples += len(samples)
            self.stats.tokens += group.num_tokens()
        finally:
            renew.cancel()
            try:
                await asyncio.shield(self.admission.release(lease, accepted=published))
            except Exception as exc:  # an expired lease or Redis down: admission recovers by expiry
                log.warning("could not release lease %s: %s", lease, exc)
            self._group_slots.release()
            if published or not (self._stop.is_set() or requeued):
                self._mark_done(local)

    async def _renew(self, lease: str) -> None:
        period = max(self.admission.lease_ms / 3000.0, 0.05)
        while True:
            await asyncio.sleep(period)
            try:
                await self.admission.renew(lease)
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)

    async def _sample(self, prompt_ids: list[int]) -> _Sample:
        """One completion, continued across aborts (partial rollout), versions tagged per segment."""
        budget = self.cfg.sampling.max_new_tokens
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        tries = _Tries()
        stalled = 0
        while True:
            remaining = budget - len(ids)
            if remaining <= 0:
                return _Sample(ids, lps, vers, "length")
            asked = min(remaining, self.cfg.max_tokens_per_request or remaining)
            params = replace(self.cfg.sampling, max_new_tokens=asked)
            try:
                await self._wait_for_weights()
                before = None if self.labelled else await self._settled_record()
                async with self._slots:
                    self.stats.requests += 1
                    result = await self.engine.generate(prompt_ids + ids, params)
                version = await self._segment_version(result, before)
            except (EngineError, _RegistryUnavailable) as exc:
                await self._after_error(exc, tries)
                continue
            self._reached(tries)
            if not self._usable(version):  # weights unknown, or too old (a restarted engine): again
                self.stats.discarded += 1
                self._saw_unusable(version)
                continue
            assert version is not None  # (_usable)
            ids += result.output_ids
            lps += result.logprobs
            vers += [version] * len(result.output_ids)
            if result.finish_reason == "length" and asked < remaining and len(result.output_ids) == asked:
                self.stats.segments += 1  # the segment cap, not the answer's budget: continue it
                continue
            if result.finish_reason != "abort":
                return _Sample(ids, lps, vers, result.finish_reason)
            self.stats.interrupted += 1
            if self._stop.is_set():
                raise asyncio.CancelledError
            stalled = 0 if result.output_ids else stalled + 1
            if stalled > self.cfg.max_retries + 5:  # aborted again and again with no progress
                raise _Dropped(f"aborted {stalled} times in a row without progress", retry=True)

    async def _after_error(self, exc: EngineError | _RegistryUnavailable, tries: _Tries) -> None:
        """Wait before a failed request is sent again, or raise _Dropped past its budget: an
        unreachable engine is waited for up to `engine_outage_s` (capped, jittered backoff), other
        errors are retried `max_retries` times (none for an error the same request would hit again)."""
        self.stats.request_errors += 1
        if engine_unreachable(exc):
            self._engine_lost = True  # it may come back as a new incarnation (on other weights)
            now = time.monotonic()
            tries.unreachable_since = now if tries.unreachable_since is None else tries.unreachable_since
            self.health.failing("engine", self.engine.url, exc, self.cfg.engine_outage_s)
            tries.waits += 1
            delay = backoff_delay(tries.waits, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s)
            if now + delay - tries.unreachable_since <= self.cfg.engine_outage_s:
                await asyncio.sleep(delay)
                return
            raise _Dropped(f"engine unreachable for {now - tries.unreachable_since:.0f}s "
                           f"(engine_outage_s={self.cfg.engine_outage_s:.0f}): {exc}", retry=True) from exc
        tries.failures += 1
        if (isinstance(exc, EngineError) and not exc.retryable) or tries.failures > self.cfg.max_retries:
            raise _Dropped(f"engine failed {tries.failures} time(s): {exc}") from exc
        await asyncio.sleep(min(self.cfg.backoff_s * 2 ** (tries.failures - 1), self.cfg.backoff_max_s))

    def _reached(self, tries: _Tries) -> None:
        """The engine answered: a later outage of this request starts its own wait."""
        tries.unreachable_since, tries.waits = None, 0
        self.health.recovered("engine", self.engine.url)

    # ------------------------------------------------------------------ held-out evaluation

    async def _evaluator(self) -> None:
        """Serve evaluation requests one at a time, for as long as the worker runs."""
        assert self.evaluation is not None
        ev = self.evaluation
        channel = EvalChannel(self.redis, self.names)
        redis_failures = failed = 0
        ready = False
        while not self._stop.is_set():
            try:
                if not ready:
                    await channel.ensure_group()
                    ready = True
                request = await channel.claim(self.cfg.engine_id, block_ms=ev.block_ms, min_idle_ms=ev.takeover_ms)
                redis_failures = 0
            except Exception as exc:  # Redis: retried like the version channel
                redis_failures += 1
                ready = False  # (the stream may have been deleted with its group)
                delay = backoff_delay(redis_failures, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s)
                log.warning("evaluation requests unavailable (retrying in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)
                continue
            if request is None:
                continue
            if await self._serve_evaluation(channel, request):
                failed = 0
                continue
            failed += 1
            await asyncio.sleep(backoff_delay(failed, base=ev.retry_s, cap=ev.retry_max_s))

    async def _serve_evaluation(self, channel: EvalChannel, request: EvalRequest) -> bool:
        """Evaluate `request.version` and complete the request; False: the pass failed, the request
        stays pending (tried again by this worker, or by another after `takeover_ms`)."""
        assert self.evaluation is not None
        ev = self.evaluation
        progress = _EvalProgress(request.version, len(ev.items) * ev.settings.samples_per_prompt)
        self._eval_progress = progress
        fresh = asyncio.create_task(self._keep_fresh(channel, request), name="evaluation-touch")
        log.info("evaluating version %d: %d prompts x %d answers", request.version, len(ev.items),
                 ev.settings.samples_per_prompt)
        try:
            record = await evaluate(_EvalEngine(self), ev.items, render=ev.render or self.render, decode=self.decode,
                                    scorer=ev.scorer, settings=ev.settings, version=request.version,
                                    version_of=_tagged_version, engine_id=self.cfg.engine_id,
                                    on_answer=progress.answered)
        except Exception as exc:  # EvaluationError, _Dropped (engine failing past its budget), ...
            self.stats.evaluations_failed += 1
            log.warning("evaluation of version %d failed after %d/%d answers (left pending, tried again): "
                        "%s: %s", request.version, progress.done, progress.total, type(exc).__name__, exc)
            return False
        finally:
            fresh.cancel()
            self._eval_progress = None
        redis_failures = 0
        while True:  # the record is in hand: retry handing it in rather than evaluating again
            try:
                entry = await channel.complete(request, record)
                break
            except Exception as exc:
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

    async def _keep_fresh(self, channel: EvalChannel, request: EvalRequest) -> None:
        """Touch the request while it is evaluated, so no other worker takes it over."""
        assert self.evaluation is not None
        while True:
            await asyncio.sleep(self.evaluation.touch_s)
            try:
                await channel.touch(self.cfg.engine_id, request)
            except Exception as exc:
                log.warning("could not touch evaluation request %s: %s", request.entry_id, exc)

    async def _eval_generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        """One eval request on the engine, outside the training slots, labelled with the version of
        its weights (`weight_version`: as a segment's, _segment_version; an answer whose weights
        cannot be named is generated again); engine errors retried like a sample's (_after_error)."""
        tries = _Tries()
        while True:
            try:
                await self._wait_for_weights()
                before = None if self.labelled else await self._settled_record()
                result = await self.engine.generate(input_ids, params)
                version = await self._segment_version(result, before)
            except (EngineError, _RegistryUnavailable) as exc:
                await self._after_error(exc, tries)
                continue
            self._reached(tries)
            if self._usable(version):
                return replace(result, weight_version=version)
            self.stats.discarded += 1
            self._saw_unusable(version)

    # ------------------------------------------------------------------ observing weight versions

    async def _segment_version(self, result: GenerateResult, before: EngineWeights | None) -> int | None:
        """The weight version that produced a segment's tokens (None: unknown, generate it again).

        Labelled engines (SGLang, vLLM 0.32, hf) say it in the answer; "default" is the initial
        weights, version 0. Engines without labels: the trainer's record, read
        before the request (`before`, waited until no update was in progress) and again now. Every
        update pauses with abort, so if no update began meanwhile, or exactly one began and cut this
        segment short, the segment ran on `before`'s weights. Otherwise it may have waited in the
        paused server and run on the new weights: unknown. So is a record of another incarnation."""
        if before is None:
            return result.weight_version  # the adapter read "default" as 0 (label_version); None: unknown
        after = await self._record()
        if after.epoch == before.epoch or (after.epoch == before.epoch + 1 and result.finish_reason == "abort"):
            return before.label_for(self.incarnation)
        return None

    async def _record(self) -> EngineWeights:
        """The trainer's record for this engine (no record: the trainer never updated it)."""
        try:
            return await self.registry.weights(self.cfg.engine_id) or EngineWeights()
        except Exception as exc:  # Redis: retried like an engine error
            raise _RegistryUnavailable(f"engine registry unavailable: {exc}") from exc

    async def _settled_record(self) -> EngineWeights:
        """The trainer's record, once no update of this engine is in progress (a request sent
        during an update would wait in the paused server and run on weights we could not name)."""
        rec = await self._record()
        if rec.in_progress():
            self.stats.held += 1
            while rec.in_progress():
                await asyncio.sleep(UPDATE_POLL_S)
                rec = await self._record()
        return rec

    async def _observe_engine(self) -> None:
        """Refresh `incarnation`, `engine_label` and `engine_version`: the engine's own label, or
        the trainer's record when it describes this incarnation (else unknown, None)."""
        lost, self._engine_lost = self._engine_lost, False
        try:
            info = await self.engine.model_info()
            raw = info.get("weight_version")
            label = None if raw is None else str(raw)
            served = info.get("incarnation")
            if served:  # the server names its life itself
                if self._named_incarnation and served != self.incarnation:
                    self._new_incarnation(str(served), "the server reports a new incarnation")
                self.incarnation, self._named_incarnation = str(served), True
            elif lost or (label == LAUNCH_LABEL and self.engine_label not in (None, LAUNCH_LABEL)):
                self._new_incarnation(uuid.uuid4().hex, f"weight label {self.engine_label!r} -> {label!r}"
                                      if not lost else "it was unreachable")
            self.engine_label = label
            # What the server serves: its label; for an engine whose answers carry none, the
            # trainer's record of this incarnation (the label still shows a restart).
            self.engine_version = (label_version(label) if self.labelled
                                   else (await self._record()).label_for(self.incarnation))
        except BaseException:
            self._engine_lost = self._engine_lost or lost
            raise

    def _new_incarnation(self, incarnation: str, why: str) -> None:
        self.stats.restarts_seen += 1
        self.incarnation = incarnation
        log.warning("engine %s may have restarted (%s): its weights are unknown until the trainer's catch-up "
                    "loads the current version (new incarnation %s)", self.engine.url, why, incarnation[:8])

    def _usable(self, version: int | None) -> bool:
        """Whether tokens of weights `version` may be generated: known, and within the admission
        bound of the current policy version (older ones would only be dropped by the trainer)."""
        return version is not None and self.version - version <= self.admission.version_bound

    def _saw_unusable(self, version: int | None) -> None:
        """An answer came from weights the worker must not use: stop until they are replaced."""
        self.engine_version = version

    async def _wait_for_weights(self) -> bool:
        """Return once the engine serves usable weights (`_usable`); until then the worker is
        Degraded and looks again every WEIGHTS_POLL_S (one waiter polls, the others wait on it).
        An engine that cannot be asked raises (EngineError: the caller's outage handling applies)."""
        if self._usable(self.engine_version) and not self._engine_lost:
            return True
        async with self._weights_lock:
            counted = False
            while True:
                await self._observe_engine()
                if self._usable(self.engine_version):
                    break
                if not counted:
                    counted = True
                    self.stats.weight_waits += 1
                serves = "unknown weights" if self.engine_version is None else f"v{self.engine_version}"
                self.health.failing("engine-weights", self.engine.url,
                                    f"engine serves {serves} (label {self.engine_label!r}), policy v{self.version}, "
                                    f"version bound {self.admission.version_bound}: waiting for the trainer's catch-up",
                                    self.cfg.engine_outage_s)
                await asyncio.sleep(WEIGHTS_POLL_S)
        self.health.recovered("engine-weights", self.engine.url)
        return True

    async def _weights_before_lease(self) -> bool:
        """The gate before a lease is taken: usable weights, waiting out an unreachable engine
        (no lease is held meanwhile, so there is no window to give up after)."""
        failures = 0
        while True:
            try:
                return await self._wait_for_weights()
            except (EngineError, _RegistryUnavailable) as exc:
                failures += 1
                self._engine_lost = True
                self.health.failing("engine", self.engine.url, exc, self.cfg.engine_outage_s)
                await asyncio.sleep(backoff_delay(failures, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s))

    async def _initial_version(self) -> None:
        try:
            await self._observe_engine()
        except (EngineError, _RegistryUnavailable) as exc:
            log.warning("could not read the engine's weight version at start: %s", exc)
        event = await self.versions.latest()
        if event is not None:
            self.version = event.version
        elif self.engine_version is not None:
            self.version = self.engine_version

    async def _follow_versions(self) -> None:
        """Follow the version channel (the policy version); the trainer updates the engine itself."""
        failures = 0
        while not self._stop.is_set():
            try:
                event = await self.versions.wait_newer(self.version, timeout=5.0)
                if event is not None:
                    self.version = event.version
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                delay = min(self.cfg.backoff_s * 2 ** failures, self.cfg.backoff_max_s)
                log.warning("version channel unavailable (retrying in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)

    async def _heartbeat(self) -> None:
        while True:
            try:
                observed = time.time()  # before reading: the trainer's record wins if it is newer
                ready = await self.engine.ready()
                if ready:
                    self.health.recovered("engine", self.engine.url)
                else:
                    self._engine_lost = True  # (not ready: starting, or gone; it may come back restarted)
                try:
                    await self._observe_engine()
                except (EngineError, _RegistryUnavailable) as exc:
                    log.warning("could not read the engine's weight version: %s", exc)
                await self.registry.register(EngineInfo(
                    engine_id=self.cfg.engine_id, url=self.cfg.engine_url or self.engine.url,
                    weight_version=self.engine_version, ready=ready, heartbeat=observed,
                    incarnation=self.incarnation, label=self.engine_label))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("engine heartbeat failed: %s", exc)
            await asyncio.sleep(self.cfg.heartbeat_s)

    # ------------------------------------------------------------------ cursor and progress

    async def _take_position(self) -> tuple[int, int]:
        """(local index, dataset position) of the next prompt: an interrupted group's first. The
        shared cursor is one atomic INCR: every position goes to exactly one worker, and the
        counter survives worker restarts."""
        if self._requeued:
            return self._requeued.pop(0)
        if self.shared_cursor:
            position = int(await self.redis.incr(self.cursor_key)) - 1
            return position, position
        return self.cursor.take()

    def _mark_done(self, local: int) -> None:
        if self.shared_cursor:
            return
        self._done_locals.add(local)
        while self._low_water in self._done_locals:
            self._done_locals.discard(self._low_water)
            self._low_water += 1
        task = asyncio.ensure_future(self._save_cursor())
        self._saves.add(task)  # keep a reference until it is done (the loop holds only weak ones)
        task.add_done_callback(self._saves.discard)

    async def _save_cursor(self) -> None:
        """Write the low-water mark. One write at a time, each of the value current when it starts:
        saves started by completions that finish close together (and the final one at shutdown)
        would otherwise race on separate connections and an older value could land last."""
        if self.shared_cursor:
            return
        async with self._cursor_lock:
            value = self._low_water
            if value == self._saved_low_water:
                return
            try:
                await self.redis.set(self.cursor_key, value)
                self._saved_low_water = value
            except Exception as exc:
                log.warning("could not save the dataset cursor: %s", exc)

    async def _restore_cursor(self) -> None:
        if self.shared_cursor:
            return
        raw = await self.redis.get(self.cursor_key)
        if raw is not None:
            self._low_water = self._saved_low_water = int(raw)
            self.cursor.next = self._low_water
            log.info("resuming shard %d/%d at prompt %d", self.cfg.rollout_index, self.cfg.rollout_replicas,
                     self._low_water)

    def summary(self) -> str:
        s = self.stats
        return (f"groups={s.groups_published} dropped={s.groups_dropped} invalid={s.groups_invalid} tokens={s.tokens} "
                f"tok/s={s.tokens_per_second():.1f} version={self.version} engine_version={self.engine_version} "
                f"interrupted={s.interrupted} held={s.held} discarded={s.discarded} requeued={s.requeued} "
                f"weight_waits={s.weight_waits} restarts={s.restarts_seen} "
                f"errors={s.request_errors} reward_errors={self.scorer.errors} in_flight={len(self._groups)} "
                f"{self._eval_summary()}degraded={self.health.summary()}")

    def _eval_summary(self) -> str:
        """`evals=2 eval=v7 30/64 ` (the running one), or nothing when the worker serves no evaluation."""
        if self.evaluation is None:
            return ""
        s, running = self.stats, self._eval_progress
        failed = f" eval_failed={s.evaluations_failed}" if s.evaluations_failed else ""
        now = f" eval=v{running.version} {running.done}/{running.total}" if running else ""
        return f"evals={s.evaluations}{failed}{now} "

    async def _log_progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.log_every_s)
            (log.warning if self.health.degraded() else log.info)("rollout %s", self.summary())
