"""The rollout worker: prompts in, version-tagged trajectory groups out, never waiting for training.

The worker is the executor of its parts:
  rollout/generation/producer.py     how a prompt becomes a group: single-turn, or the job's episode
  rollout/generation/groups.py       one prompt's group: samples generated across aborts, scored, checked
  rollout/generation/engine_view.py  the engine's weights as the worker observes them, and labelled requests
  rollout/evaluation/service.py    held-out evaluation requests served on the same engine (spec.evaluation)
  rollout/worker/prompt_cursor.py which prompt comes next, resumable, interrupted prompts first
  rollout/data/mixture.py      what a position is: its source (of a mixture), prompt, rendering and reward
What it owns itself:
  run()           takes an admission lease per group (blocks when the global staleness budget is
                  spent: the worker does not buffer), picks the next prompt of its shard, starts
                  the group as a task; the version follower, the registry heartbeat, the progress
                  line and (with `evaluation`) the evaluator run beside it.
  _run_group()    the group, published with one XADD, the lease released as accepted. A
                  group whose sample keeps failing, or that check_group refuses, is dropped (lease
                  released unaccepted, counted job-wide as `generation_failures` with its error,
                  logged with the reason; its prompt is not retried), never published: a poison
                  group would only be dead-lettered by the trainer. A
                  group whose reward failed (spec.reward.onError drop) is dropped the same way, and
                  dead-lettered and counted job-wide (`reward_failures` in the trainer's /status);
                  so is a group whose episode function failed past its retries (`episode_failures`,
                  rollout/episodes/runner.py). A
                  group interrupted by its engine going away (unreachable past `engine_outage_s`,
                  or aborted again and again) is not the prompt's fault: its prompt is queued again
                  and generated anew (counted as `requeued`, and job-wide as `engine_requeues`),
                  never marked done unanswered. The job-wide counts keep each cause's newest error:
                  a job that stands still names its cause (trainer/report/stall.py).
The worker never pauses, updates or resumes its engine: the trainer alone does that, for every
engine (trainer/weights/engine_update.py).
Shutdown (SIGTERM/stop()): stop taking leases, cancel in-flight groups, release their leases
unaccepted, cancel a running evaluation (its request stays pending: this worker after a restart,
or another one after `takeover_ms`, serves it), remove the engine from the registry. The wait for
a lease and the side tasks are cancelled again until they end (cancel_and_wait: Python 3.11 can
lose a cancellation in the Redis client, which left a stopping worker polling for a lease forever).
Outages: Redis commands block through an outage of up to the client's window (the client's retry
policy, asyncrl/transport/connection.py), engine requests through `engine_outage_s`; meanwhile the
worker is Degraded: the outage is logged when it starts, while it lasts and when it ends, and the
progress line says `degraded=redis(12s)` (asyncrl.infra.health.HEALTH).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.health import HEALTH, Health
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines.base import Engine
from asyncrl.rollout.evaluation.service import Evaluator, WorkerEvaluation
from asyncrl.rollout.generation.config import WorkerConfig, WorkerStats
from asyncrl.rollout.generation.engine_view import Dropped, EngineView
from asyncrl.rollout.generation.groups import GroupGenerator, InvalidGroup, RefusedGroup, UnscoredGroup
from asyncrl.rollout.generation.producer import GroupProducer, SingleTurn
from asyncrl.rollout.worker.prompt_cursor import PromptCursor
from asyncrl.transport.admission import Admission, FailureCause
from asyncrl.transport.connection import reraise_if_cancelled
from asyncrl.transport.streams import TrajectoryProducer
from asyncrl.transport.versions import EngineRegistry, VersionChannel

log = logging.getLogger("asyncrl.rollout.worker")

SIDE_TASK_STOP_S = 10.0
"""How long a stopping worker waits for its heartbeat, progress, version-following and evaluator tasks."""
CANCEL_AGAIN_S = 1.0
"""How often a stopping worker repeats the cancellation of a task that has not ended (see cancel_and_wait)."""


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



class RolloutWorker:
    def __init__(self, cfg: WorkerConfig, *, engine: Engine, redis: Any, prompts: Mixture,
                 decode: Callable[[list[int]], str], admission: Admission, names: StreamNames | None = None,
                 health: Health = HEALTH, evaluation: WorkerEvaluation | None = None,
                 producer: GroupProducer | None = None):
        self.cfg = cfg
        self.health = health
        """Where outages are recorded (the process's board: the Redis client reports to it too)."""
        self.engine = engine
        self.redis = redis
        self.prompts = prompts
        """Which prompt each position is, with its source's rendering and reward (rollout/data/mixture.py)."""
        self.admission = admission
        self.evaluation = evaluation
        """Held-out evaluation to serve (read when run() starts); None: none."""
        self.producer = producer or SingleTurn(decode)
        """How a prompt becomes a group: the job's episode (spec.rollout.episode; default single-turn)."""
        self.names = names or StreamNames.for_job(cfg.job)
        self.trajectories = TrajectoryProducer(redis, self.names)
        self.registry = EngineRegistry(redis, self.names)
        self.stats = WorkerStats()
        self._stop = asyncio.Event()
        self.view = EngineView(cfg, engine=engine, registry=self.registry, versions=VersionChannel(redis, self.names),
                               admission=admission, stats=self.stats, health=health)
        self.groups = GroupGenerator(cfg, view=self.view, decode=decode, stats=self.stats, stopping=self._stop)
        self.decode = decode
        self.evaluator: Evaluator | None = None
        """Serves `evaluation` once run() has started (None: it serves none)."""
        self.cursor = PromptCursor(redis, self.names, cfg.rollout_index, cfg.rollout_replicas)
        self._group_slots = asyncio.Semaphore(max(1, math.ceil(cfg.max_concurrent_requests / cfg.group_size)))
        self._groups: set[asyncio.Task] = set()
        # leases of group tasks not yet running: a task cancelled before its first step never runs its
        # body, so its `finally` could not release the lease (a stop right after a lease was granted)
        self._unstarted: dict[asyncio.Task, str] = {}

    @property
    def version(self) -> int:
        """The newest policy version observed on the version channel."""
        return self.view.version

    @property
    def engine_version(self) -> int | None:
        """The engine's weight version as last observed (None: unknown)."""
        return self.view.engine_version

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

    def _side_tasks(self) -> list[asyncio.Task]:
        if self.evaluation is not None:
            self.evaluator = Evaluator(self.evaluation, self.cfg, redis=self.redis, names=self.names, view=self.view,
                                       render=self.prompts.lanes[0].render, decode=self.decode, stats=self.stats,
                                       producer=self.producer)
        side = [asyncio.create_task(self.view.heartbeat(), name="heartbeat"),
                asyncio.create_task(self._log_progress(), name="progress"),
                asyncio.create_task(self.view.follow_versions(self._stop), name="versions")]
        if self.evaluator is not None:
            side.append(asyncio.create_task(self.evaluator.run(self._stop), name="evaluator"))
        return side

    async def run(self) -> WorkerStats:
        await self._return_leases()
        await self.cursor.restore()
        await self.view.initial_version()
        side = self._side_tasks()
        try:
            await self._start_groups()
            while not self._stop.is_set() and self._groups:  # (an interrupted one may be queued again)
                await self._wait_or_stop(asyncio.gather(*list(self._groups), return_exceptions=True))
                if self.cursor.requeued and not self._stop.is_set():
                    await self._run_requeued()
        finally:
            await self._shut_down(side)
        return self.stats

    async def _start_groups(self) -> None:
        """Start a group per lease until stopped (or `max_groups` new prompts were started)."""
        started = 0
        while not self._stop.is_set() and (self.cfg.max_groups is None or started < self.cfg.max_groups):
            if not await self._wait_or_stop(self._group_slots.acquire()):
                return
            if not await self._wait_or_stop(self.view.weights_before_lease()):
                self._group_slots.release()
                return
            lease = await self._wait_or_stop(self.admission.acquire(self.cfg.engine_id))
            if lease is None:
                self._group_slots.release()
                return
            again = bool(self.cursor.requeued)  # (an interrupted group's prompt: not a new start)
            self._start(lease, *await self.cursor.take())
            started += 0 if again else 1

    def _start(self, lease: str, local: int, position: int) -> None:
        task = asyncio.create_task(self._run_group(lease, local, position), name=f"group-{local}")
        self._groups.add(task)
        self._unstarted[task] = lease
        task.add_done_callback(self._groups.discard)

    async def _shut_down(self, side: list[asyncio.Task]) -> None:
        for task in list(self._groups):
            task.cancel()
        if self._groups:
            await asyncio.gather(*list(self._groups), return_exceptions=True)
        for lease in self._unstarted.values():  # (their prompts were not marked done: redone after a restart)
            try:
                await self.admission.release(lease, accepted=False)
            except Exception as exc:  # Redis gone: admission recovers the slot by expiry
                log.warning("could not release lease %s: %s", lease, exc)
        self._unstarted.clear()
        # bounded: a helper stuck in a client that swallowed its cancellation must not hold the
        # shutdown (and the cursor save below) for a whole outage window
        stuck = await cancel_and_wait(side, timeout=SIDE_TASK_STOP_S)
        if stuck:
            log.warning("stopping without waiting for %s (did not stop within %.0fs)",
                        ", ".join(t.get_name() for t in stuck), SIDE_TASK_STOP_S)
        await self.cursor.save()
        try:
            await self.registry.remove(self.cfg.engine_id)
        except Exception as exc:  # Redis gone during shutdown: nothing left to clean
            log.warning("could not remove engine %s from the registry: %s", self.cfg.engine_id, exc)
        scorers = self.prompts.scorers()
        for scorer in scorers:
            scorer.close()
        if self.evaluator is not None:
            self.evaluator.close(scorers)
        self.producer.close()
        log.info("rollout worker stopped: %s", self.summary())

    async def _run_requeued(self) -> None:
        """After the last new group (max_groups): start the interrupted groups' prompts again."""
        while self.cursor.requeued and not self._stop.is_set():
            if not await self._wait_or_stop(self._group_slots.acquire()):
                return
            lease = await self._wait_or_stop(self.admission.acquire(self.cfg.engine_id))
            if lease is None:
                self._group_slots.release()
                return
            self._start(lease, *await self.cursor.take())

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
        self._unstarted.pop(asyncio.current_task(), None)  # type: ignore[arg-type]  # (always a task here)
        published = requeued = False
        renew = asyncio.create_task(self._renew(lease))
        try:
            lane, item = self.prompts.pick(position)
            try:
                group = await self.producer.group(self.groups, item, lane)
            except Dropped as exc:
                if exc.retry:
                    requeued = True
                    self.stats.requeued += 1
                    self.cursor.requeue(local, position)
                    log.warning("group for prompt %s interrupted, its prompt is queued again: %s", item.prompt_id, exc)
                    await self._record_failure("engine_requeues", item.prompt_id, exc)
                    return
                self.stats.groups_dropped += 1
                log.warning("dropped group for prompt %s: %s", item.prompt_id, exc)
                await self._record_failure("generation_failures", item.prompt_id, exc)
                return
            except InvalidGroup as exc:  # dropped like a failed generation: the trainer could not train it
                self.stats.groups_dropped += 1
                self.stats.groups_invalid += 1
                log.warning("dropped group for prompt %s (not published): %s", item.prompt_id, exc)
                await self._record_failure("generation_failures", item.prompt_id, exc)
                return
            except RefusedGroup as exc:
                await self._drop_refused(item.prompt_id, exc)
                return
            await self.trajectories.publish(group)
            published = True
            self.stats.groups_published += 1
            self.stats.samples += len(group.samples)
            self.stats.tokens += group.num_tokens()
        finally:
            renew.cancel()
            try:
                await asyncio.shield(self.admission.release(lease, accepted=published))
            except Exception as exc:  # an expired lease or Redis down: admission recovers by expiry
                log.warning("could not release lease %s: %s", lease, exc)
            self._group_slots.release()
            if published or not (self._stop.is_set() or requeued):
                self.cursor.mark_done(local)

    async def _drop_refused(self, prompt_id: str, exc: RefusedGroup) -> None:
        """A group whose reward or episodes failed is never trained with a made-up reward: not published
        (its lease goes back unaccepted), dead-lettered with the reason, counted job-wide; its prompt
        is not retried."""
        self.stats.groups_dropped += 1
        unscored = isinstance(exc, UnscoredGroup)
        if unscored:
            self.stats.groups_unscored += 1
        else:
            self.stats.groups_failed += 1
        log.warning("dropped group for prompt %s (not published): %s", prompt_id, exc)
        try:
            await self.trajectories.dead_letter_refused(exc.group, exc.kind, str(exc), self.cfg.engine_id)
        except Exception as err:  # Redis gone past its outage window: the drop stands, only its record is lost
            reraise_if_cancelled(err)
            log.warning("could not dead-letter the dropped group for prompt %s: %s", prompt_id, err)
        await self._record_failure("reward_failures" if unscored else "episode_failures", prompt_id, exc)

    async def _record_failure(self, cause: FailureCause, prompt_id: str, exc: BaseException) -> None:
        """Count a group that was not published, job-wide, with its error (what a stalled job's
        report quotes: asyncrl/transport/admission.py)."""
        try:
            await self.admission.record_failure(cause, f"prompt {prompt_id}: {exc}")
        except Exception as err:  # Redis gone past its outage window: the drop stands, only its count is lost
            reraise_if_cancelled(err)
            log.warning("could not count the group for prompt %s in %s: %s", prompt_id, cause, err)

    async def _renew(self, lease: str) -> None:
        period = max(self.admission.lease_ms / 3000.0, 0.05)
        while True:
            await asyncio.sleep(period)
            try:
                await self.admission.renew(lease)
            except Exception as exc:
                reraise_if_cancelled(exc)
                log.warning("lease renewal failed: %s", exc)

    # ------------------------------------------------------------------ progress

    def summary(self) -> str:
        s, v = self.stats, self.view
        scorers = self.prompts.scorers()
        reward_errors, reward_retries = sum(s.errors for s in scorers), sum(s.retried for s in scorers)
        evals = "" if self.evaluator is None else self.evaluator.summary()
        return (f"groups={s.groups_published} dropped={s.groups_dropped} invalid={s.groups_invalid} "
                f"unscored={s.groups_unscored} failed={s.groups_failed} tokens={s.tokens} "
                f"tok/s={s.tokens_per_second():.1f} version={v.version} engine_version={v.engine_version} "
                f"interrupted={s.interrupted} held={s.held} discarded={s.discarded} requeued={s.requeued} "
                f"weight_waits={s.weight_waits} restarts={s.restarts_seen} errors={s.request_errors} "
                f"reward_errors={reward_errors} reward_retries={reward_retries} in_flight={len(self._groups)} "
                f"{evals}degraded={self.health.summary()}")

    async def _log_progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.log_every_s)
            (log.warning if self.health.degraded() else log.info)("rollout %s", self.summary())
