"""A rollout worker's view of its engine: which weights it serves, and requests labelled with them.

The worker never pauses, updates or resumes its engine: the trainer alone does that, for every
engine (trainer/weights/engine_update.py). The view observes: the version channel (the policy version), the
engine's weight version and label as the server reports them, and the server's incarnation
(registered with each heartbeat). The incarnation is the server's own id when it reports one (our
hf server), else minted here: anew at worker start, and whenever the server may have restarted
(its label went back to "default" from a trained version, or it could not be reached and answers
again). A false alarm costs one reload by the trainer; a missed restart cannot mislabel answers
that carry their label, and for an engine without labels is ruled out by the reconnect rule.

  generate()        one request, answered by weights the worker may use, with their version on the
                    answer (`weight_version`): the episode's segments and the evaluator's answers
                    both go through it. Engine errors are retried on a per-request budget
                    (RequestBudget); an unreachable engine (restarting, rescheduled) is waited for,
                    with capped exponential backoff and jitter, for `engine_outage_s`.
  segment_label()   where that version comes from: the label the engine puts on its answer
                    (SGLang, vLLM 0.32, our hf server; "default" is the base model, version 0, and
                    "N@T" version N of trainer timeline T, see asyncrl.api.weight_labels), or, for an
                    engine without one, the trainer's record for this engine in the EngineRegistry,
                    read before and after the request,
                    if that record describes the engine's current incarnation. Never a guess: an
                    answer whose version cannot be named is discarded and generated again.
  wait_for_weights() the gate before every lease and request: the worker generates only on an
                    engine whose version is known and within the admission bound (policy version -
                    engine version <= the version bound). A restarted engine (serving the base
                    model, or weights nobody can name) is not used until the trainer's catch-up has
                    loaded the current version into it; meanwhile the worker is Degraded
                    (`degraded=engine-weights(...)`, logged) and counts the waits (`weight_waits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, replace

import httpx

from asyncrl.api.weight_labels import LAUNCH_LABEL, WeightLabel, parse_label
from asyncrl.infra.health import Health, backoff_delay
from asyncrl.rollout.engines.base import (
    Engine,
    EngineError,
    GenerateResult,
    SamplingParams,
)
from asyncrl.rollout.generation.config import WorkerConfig, WorkerStats
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import reraise_if_cancelled
from asyncrl.transport.versions import EngineInfo, EngineRegistry, EngineWeights, VersionChannel

log = logging.getLogger("asyncrl.rollout.worker")

WEIGHTS_POLL_S = 0.5
"""How often a worker waiting for usable weights (wait_for_weights) looks at its engine again."""
UPDATE_POLL_S = 0.05
"""How often a request for an engine without weight labels re-reads the trainer's record while the
trainer is updating that engine."""
_OUTAGE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                  httpx.RemoteProtocolError)
_OUTAGE_STATUS = frozenset({502, 503, 504})


def engine_unreachable(exc: BaseException) -> bool:
    """Whether an engine error means the server is not there right now (refused, reset, gone
    mid-answer, or a proxy saying so), as opposed to a server that answered with an error: the
    first is waited out, the second is retried `max_retries` times and then drops the group."""
    if not isinstance(exc, EngineError):
        return False
    return isinstance(exc.__cause__, _OUTAGE_ERRORS) or exc.status in _OUTAGE_STATUS


class Dropped(Exception):
    """A request failed past its budget: its group is dropped (`retry`: its prompt is queued
    again, as the failure was the engine's, not the prompt's)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class RegistryUnavailable(Exception):
    """The trainer's record of an unlabelled engine could not be read (retried like an engine error)."""


@dataclass
class RequestBudget:
    """One request's error budget so far (see EngineView.after_error); a sample keeps one across
    its segments, so its engine errors add up."""

    failures: int = 0
    unreachable_since: float | None = None
    waits: int = 0


class EngineView:
    """The engine as one worker sees it; every part of the worker reads the same view."""

    def __init__(self, cfg: WorkerConfig, *, engine: Engine, registry: EngineRegistry, versions: VersionChannel,
                 admission: Admission, stats: WorkerStats, health: Health) -> None:
        self.cfg = cfg
        self.engine = engine
        self.registry = registry
        self.versions = versions
        self.admission = admission
        self.stats = stats
        self.health = health
        self.version = 0
        """The newest policy version on the version channel (observed; the worker updates nothing)."""
        self.engine_weights: WeightLabel | None = None
        """The engine's weights as last observed (its label, or the trainer's record); None: unknown."""
        self.engine_label: str | None = None
        """The engine's weight label exactly as the server last reported it (None: it reports none)."""
        self.incarnation = uuid.uuid4().hex
        """The engine server's life as far as this worker knows (see the module docstring)."""
        self.labelled = engine.reports_weight_version
        self._engine_lost = False
        """The engine could not be reached since the last observation: it may have restarted."""
        self._named_incarnation = False
        """Whether `incarnation` is the server's own id (our hf server), not one minted here."""
        self._weights_lock = asyncio.Lock()

    # ------------------------------------------------------------------ labelled requests

    async def generate(self, input_ids: list[int], params: SamplingParams, budget: RequestBudget,
                       slots: asyncio.Semaphore | None = None) -> GenerateResult:
        """One request on usable weights, `weight_version` set to theirs (see the module docstring);
        sent while holding one of `slots` when given. Raises Dropped past `budget`."""
        while True:
            try:
                await self.wait_for_weights()
                before = None if self.labelled else await self.settled_record()
                async with slots if slots is not None else contextlib.nullcontext():
                    self.stats.requests += 1
                    result = await self.engine.generate(input_ids, params)
                label = await self.segment_label(result, before)
            except (EngineError, RegistryUnavailable) as exc:
                await self.after_error(exc, budget)
                continue
            self.reached(budget)
            if label is not None and self.usable(label):
                return replace(result, weight_version=label.version, weight_timeline=label.timeline)
            self.stats.discarded += 1  # weights unknown, or too old (a restarted engine): again
            self.engine_weights = label  # (and stop generating until they are replaced)

    async def after_error(self, exc: EngineError | RegistryUnavailable, budget: RequestBudget) -> None:
        """Wait before a failed request is sent again, or raise Dropped past its budget: an
        unreachable engine is waited for up to `engine_outage_s` (capped, jittered backoff), other
        errors are retried `max_retries` times (none for an error the same request would hit again)."""
        self.stats.request_errors += 1
        if engine_unreachable(exc):
            self._engine_lost = True  # it may come back as a new incarnation (on other weights)
            now = time.monotonic()
            budget.unreachable_since = now if budget.unreachable_since is None else budget.unreachable_since
            self.health.failing("engine", self.engine.url, exc, self.cfg.engine_outage_s)
            budget.waits += 1
            delay = backoff_delay(budget.waits, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s)
            if now + delay - budget.unreachable_since <= self.cfg.engine_outage_s:
                await asyncio.sleep(delay)
                return
            raise Dropped(f"engine unreachable for {now - budget.unreachable_since:.0f}s "
                          f"(engine_outage_s={self.cfg.engine_outage_s:.0f}): {exc}", retry=True) from exc
        budget.failures += 1
        if (isinstance(exc, EngineError) and not exc.retryable) or budget.failures > self.cfg.max_retries:
            raise Dropped(f"engine failed {budget.failures} time(s): {exc}") from exc
        await asyncio.sleep(min(self.cfg.backoff_s * 2 ** (budget.failures - 1), self.cfg.backoff_max_s))

    def reached(self, budget: RequestBudget) -> None:
        """The engine answered: a later outage of this request starts its own wait."""
        budget.unreachable_since, budget.waits = None, 0
        self.health.recovered("engine", self.engine.url)

    # ------------------------------------------------------------------ which weights

    @property
    def engine_version(self) -> int | None:
        """The version of `engine_weights` (None: unknown)."""
        return None if self.engine_weights is None else self.engine_weights.version

    async def segment_label(self, result: GenerateResult, before: EngineWeights | None) -> WeightLabel | None:
        """The weights that produced an answer's tokens (None: unknown, generate it again).

        Labelled engines (SGLang, vLLM 0.32, hf) say it in the answer; "default" is the initial
        weights, version 0. Engines without labels: the trainer's record, read before the request
        (`before`, waited until no update was in progress) and again now. Every update pauses with
        abort, so if no update began meanwhile, or exactly one began and cut this answer short, it
        ran on `before`'s weights. Otherwise it may have waited in the paused server and run on the
        new weights: unknown. So is a record of another incarnation."""
        if before is None:  # (the adapter read "default" as version 0; None: unknown)
            return None if result.weight_version is None else WeightLabel(result.weight_version,
                                                                          result.weight_timeline)
        after = await self.record()
        if after.epoch == before.epoch or (after.epoch == before.epoch + 1 and result.finish_reason == "abort"):
            return before.label_for(self.incarnation)
        return None

    async def record(self) -> EngineWeights:
        """The trainer's record for this engine (no record: the trainer never updated it)."""
        try:
            return await self.registry.weights(self.cfg.engine_id) or EngineWeights()
        except Exception as exc:  # Redis: retried like an engine error
            raise RegistryUnavailable(f"engine registry unavailable: {exc}") from exc

    async def settled_record(self) -> EngineWeights:
        """The trainer's record, once no update of this engine is in progress (a request sent
        during an update would wait in the paused server and run on weights we could not name)."""
        rec = await self.record()
        if rec.in_progress():
            self.stats.held += 1
            while rec.in_progress():
                await asyncio.sleep(UPDATE_POLL_S)
                rec = await self.record()
        return rec

    async def observe(self) -> None:
        """Refresh `incarnation`, `engine_label` and `engine_weights`: the engine's own label, or
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
            self.engine_weights = (parse_label(label) if self.labelled
                                   else (await self.record()).label_for(self.incarnation))
        except BaseException:
            self._engine_lost = self._engine_lost or lost
            raise

    def _new_incarnation(self, incarnation: str, why: str) -> None:
        self.stats.restarts_seen += 1
        self.incarnation = incarnation
        log.warning("engine %s may have restarted (%s): its weights are unknown until the trainer's catch-up "
                    "loads the current version (new incarnation %s)", self.engine.url, why, incarnation[:8])

    def usable(self, weights: WeightLabel | None) -> bool:
        """Whether tokens of `weights` may be generated: known, and within the admission bound of
        the current policy version (older ones would only be dropped by the trainer)."""
        return weights is not None and self.version - weights.version <= self.admission.staleness.version_bound

    async def wait_for_weights(self) -> bool:
        """Return once the engine serves usable weights (`usable`); until then the worker is
        Degraded and looks again every WEIGHTS_POLL_S (one waiter polls, the others wait on it).
        An engine that cannot be asked raises (EngineError: the caller's outage handling applies)."""
        if self.usable(self.engine_weights) and not self._engine_lost:
            return True
        async with self._weights_lock:
            counted = False
            while True:
                await self.observe()
                if self.usable(self.engine_weights):
                    break
                if not counted:
                    counted = True
                    self.stats.weight_waits += 1
                serves = "unknown weights" if self.engine_weights is None else f"v{self.engine_weights}"
                bound = self.admission.staleness.version_bound
                self.health.failing("engine-weights", self.engine.url,
                                    f"engine serves {serves} (label {self.engine_label!r}), policy v{self.version}, "
                                    f"version bound {bound}: waiting for the trainer's catch-up",
                                    self.cfg.engine_outage_s)
                await asyncio.sleep(WEIGHTS_POLL_S)
        self.health.recovered("engine-weights", self.engine.url)
        return True

    async def weights_before_lease(self) -> bool:
        """The gate before a lease is taken: usable weights, waiting out an unreachable engine
        (no lease is held meanwhile, so there is no window to give up after)."""
        failures = 0
        while True:
            try:
                return await self.wait_for_weights()
            except (EngineError, RegistryUnavailable) as exc:
                failures += 1
                self._engine_lost = True
                self.health.failing("engine", self.engine.url, exc, self.cfg.engine_outage_s)
                await asyncio.sleep(backoff_delay(failures, base=self.cfg.backoff_s, cap=self.cfg.backoff_max_s))

    # ------------------------------------------------------------------ side tasks of the worker

    async def initial_version(self) -> None:
        try:
            await self.observe()
        except (EngineError, RegistryUnavailable) as exc:
            log.warning("could not read the engine's weight version at start: %s", exc)
        event = await self.versions.latest()
        if event is not None:
            self.version = event.version
        elif self.engine_version is not None:
            self.version = self.engine_version

    async def follow_versions(self, stopping: asyncio.Event) -> None:
        """Follow the version channel (the policy version); the trainer updates the engine itself."""
        failures = 0
        while not stopping.is_set():
            try:
                event = await self.versions.wait_newer(self.version, timeout=5.0)
                if event is not None:
                    self.version = event.version
                failures = 0
            except Exception as exc:
                reraise_if_cancelled(exc)
                failures += 1
                delay = min(self.cfg.backoff_s * 2 ** failures, self.cfg.backoff_max_s)
                log.warning("version channel unavailable (retrying in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)

    async def heartbeat(self) -> None:
        """Register the engine (URL, readiness, weights, incarnation) every `heartbeat_s`."""
        while True:
            try:
                observed = time.time()  # before reading: the trainer's record wins if it is newer
                ready = await self.engine.ready()
                if ready:
                    self.health.recovered("engine", self.engine.url)
                else:
                    self._engine_lost = True  # (not ready: starting, or gone; it may come back restarted)
                try:
                    await self.observe()
                except (EngineError, RegistryUnavailable) as exc:
                    log.warning("could not read the engine's weight version: %s", exc)
                await self.registry.register(EngineInfo(
                    engine_id=self.cfg.engine_id, url=self.cfg.engine_url or self.engine.url,
                    weight_version=self.engine_version, ready=ready, heartbeat=observed,
                    incarnation=self.incarnation, label=self.engine_label,
                    weight_timeline=self.engine_weights.timeline if self.engine_weights else 0))
            except Exception as exc:
                reraise_if_cancelled(exc)
                log.warning("engine heartbeat failed: %s", exc)
            await asyncio.sleep(self.cfg.heartbeat_s)
