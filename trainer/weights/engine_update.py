"""Weight sync: the trainer is the one owner of every rollout engine's weights.

After files.py wrote `weights/v{N}` and the version event went out, `update_engines` updates
every engine registered for the job, concurrently, each under one timeout, in this order (as
AReaL does: pause -> update -> set version -> continue):

  1. registry.begin_update(engine, N)  the trainer's record says "updating to N": rollout workers
                                       of engines without a weight label hold new requests
  2. engine.pause("abort")             running requests end and return their partial output
  3. engine.update_weights(vN, N)      load the directory; SGLang, vLLM and our hf server label
                                       every answer N
  4. registry.end_update(engine)       the record: this engine serves N (the label of an engine without one)
  5. engine.resume()                   workers re-send prompt + partial output; every token from
                                       here on was produced by vN and is tagged N

A failure still clears the marker and resumes a paused engine (a server is never left paused);
the failures of all engines are raised together as one WeightSyncError naming each server. An
engine that nothing answers for at its address (connection refused or not made in time: its pod
is gone, or its server is restarting) is also removed from the registry: a dead pod's entry would
otherwise stay until its heartbeat is `max_age_s` old and fail every publish meanwhile (its worker
deregisters on SIGTERM, but not when it is killed or cannot reach Redis), while a live worker
registers its engine again at its next heartbeat.

Only ready engines are updated (one that is still loading its model is caught up once it is
ready). An engine whose update fails is fenced in the registry (EngineRegistry.fence: the record
says why, the failure is logged and counted by the caller): pushes leave it out, so one bad
rollout pod neither slows every publish by a timeout nor stops training; catch-up tries it again
after a backoff (FENCE_BACKOFF_S, doubling, at most FENCE_BACKOFF_MAX_S), and the first update
that succeeds unfences it. Its worker generates nothing meanwhile: its engine serves a version
beyond the admission bound, or one it cannot name.

Rollout workers never pause, update or resume an engine: they only observe (the label SGLang puts
on each answer, or for an engine without labels the record above; see
rollout/generation/engine_view.py). So the trainer also owns
`catch_up`: an engine that joined or restarted since the last publish (its registered version is
not the policy version, or is unknown: a restarted server the trainer's record no longer
describes) gets the current version from the weights volume before its worker serves rollout
on it, as it would have at the next publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.api.weight_labels import WeightLabel
from asyncrl.infra.errors import TrainerError
from asyncrl.rollout.engines import Engine, make_engine
from asyncrl.rollout.engines.base import EngineError
from asyncrl.trainer.weights.broadcast import CollectiveSync, GroupMember
from asyncrl.transport.versions import EngineInfo, EngineRegistry

log = logging.getLogger("asyncrl.trainer.weights.engine_update")

FENCE_BACKOFF_S = 5.0
FENCE_BACKOFF_MAX_S = 120.0
"""Catch-up retries a fenced engine after FENCE_BACKOFF_S, doubling with each failure in a row, up to this."""


class WeightSyncError(TrainerError, RuntimeError):
    """One or more engines failed to pause, load or resume; the message names each server."""

    reason = "WeightSyncFailed"
    """The job's Failed reason when too many syncs in a row fail (trainer/loop.py)."""

    def __init__(self, failures: dict[str, str], *, fenced: Sequence[str] = (), updated: int = 0):
        self.failures = failures
        self.fenced = list(fenced)
        """The engine ids fenced by this failure (registry entries; bare URLs are not fenced)."""
        self.updated = updated
        """Engines that did load the version (the others' failures do not undo theirs)."""
        detail = "; ".join(f"{url}: {err}" for url, err in failures.items())
        super().__init__(f"weight update failed on {len(failures)} engine(s): {detail}")


@dataclass
class SyncResult:
    seconds: float
    engines: int
    """Engines updated."""
    skipped: tuple[str, ...] = ()
    """URLs of registered engines left out: not ready, or fenced (catch-up retries those)."""


async def update_engines(kind: str, engines: Sequence[EngineInfo | str], path: Path, version: WeightLabel | int, *,
                         registry: EngineRegistry | None = None, timeout_s: float = 120.0,
                         include_fenced: bool = False, api_key: str | None = None,
                         collective: CollectiveSync | None = None, adapters: bool = False) -> SyncResult:
    """Update every ready engine to `version` (steps 1-5 above), concurrently; raise naming the failures.

    `engines`: registry entries (not ready ones, and fenced ones unless `include_fenced`, are left
    out); a bare URL is updated without a record (nothing to label by). A registry entry that
    fails is fenced (`WeightSyncError.fenced`). `api_key`: the engines' --api-key, sent as a bearer
    token. `collective`: step 3 is one broadcast to all the paused engines (trainer/weights/broadcast.py);
    an engine it did not load loads `path` from disk instead. `adapters`: `path` is a LoRA adapter the
    engines hold by name (make_engine). Each step has `timeout_s`.
    """
    start = time.perf_counter()
    version = WeightLabel.of(version)
    chosen = [e for e in engines if isinstance(e, str) or (e.ready and (include_fenced or not e.fenced))]
    skipped = tuple(e.url for e in engines if not isinstance(e, str) and e not in chosen)
    targets = [_Target(e, make_engine(kind, e if isinstance(e, str) else e.url, timeout=timeout_s,
                                      api_key=api_key, adapters=adapters)) for e in chosen]
    try:
        await asyncio.gather(*(t.attempt(_pause(t, registry, version, timeout_s), timeout_s) for t in targets))
        paused = [t for t in targets if t.error is None]
        if collective is not None and paused:
            missed = await collective.sync([t.member() for t in paused], path, version)
            for t in paused:
                if t.url in missed:
                    log.warning("%s: collective weight sync failed (%s): loading v%s from disk", t.url,
                                missed[t.url], version)
                else:
                    t.loaded = True
        await asyncio.gather(*(t.attempt(_load_from_disk(t, path, version), timeout_s)
                               for t in paused if not t.loaded))
        await asyncio.gather(*(_release(t, registry, timeout_s) for t in targets))
    finally:
        await asyncio.gather(*(t.client.close() for t in targets), return_exceptions=True)

    failures = {t.url: t.error for t in targets if t.error is not None}
    if not failures:
        return SyncResult(seconds=time.perf_counter() - start, engines=len(chosen), skipped=skipped)
    fenced = []
    for t in targets:
        if t.error is None or registry is None or t.engine_id is None:
            continue
        if t.exc is not None and unreachable(t.exc):
            try:
                await registry.remove(t.engine_id)
                failures[t.url] += " (unregistered until its worker's next heartbeat)"
            except Exception as remove_exc:
                log.warning("%s: could not unregister the unreachable engine: %s", t.url, remove_exc)
        try:
            await registry.fence(t.engine_id, failures[t.url], backoff_s=FENCE_BACKOFF_S,
                                 backoff_max_s=FENCE_BACKOFF_MAX_S)
            fenced.append(t.engine_id)
        except Exception as exc:  # Redis down: the next push tries it again, nothing worse
            log.warning("%s: could not fence the failing engine: %s", t.url, exc)
    raise WeightSyncError(failures, fenced=fenced, updated=len(chosen) - len(failures))


def unreachable(exc: BaseException) -> bool:
    """Whether nothing answered at the engine's address (refused, unresolvable, or no connection in time)."""
    import httpx

    cause = exc.__cause__ if isinstance(exc, EngineError) else exc
    return isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout))


class _Target:
    """One engine through steps 1-5: its client, how far it got, and its first failure."""

    def __init__(self, engine: EngineInfo | str, client: Engine):
        self.url: str = engine if isinstance(engine, str) else engine.url
        self.engine_id: str | None = None if isinstance(engine, str) else engine.engine_id
        self.incarnation: str | None = None if isinstance(engine, str) else engine.incarnation
        self.client = client
        self.marked = False
        self.loaded = False
        self.error: str | None = None
        self.exc: BaseException | None = None

    async def attempt(self, step: Awaitable[None], timeout_s: float) -> None:
        """Run one step under `timeout_s`; a failure is recorded with the server's url, not raised."""
        try:
            await asyncio.wait_for(step, timeout_s)
        except asyncio.TimeoutError:
            self.error = f"no answer within {timeout_s:g}s"
        except Exception as exc:  # reported with the server's url
            self.error, self.exc = f"{type(exc).__name__}: {exc}", exc

    def member(self) -> GroupMember:
        return GroupMember(url=self.url, engine_id=self.engine_id or self.url,
                           incarnation=self.incarnation or "", client=self.client)


async def _pause(t: _Target, registry: EngineRegistry | None, version: WeightLabel, timeout_s: float) -> None:
    """Steps 1-2: mark the record "updating to `version`", then pause (running requests abort)."""
    if registry is not None and t.engine_id is not None:
        await registry.begin_update(t.engine_id, version, timeout_s)
        t.marked = True
    await t.client.pause(mode="abort")


async def _load_from_disk(t: _Target, path: Path, version: WeightLabel) -> None:
    """Step 3 over the shared volume."""
    await t.client.update_weights(str(path), version)
    t.loaded = True


async def _release(t: _Target, registry: EngineRegistry | None, timeout_s: float) -> None:
    """Steps 4-5, also after a failed or timed-out pause or load: clear the mark, never leave a server
    paused. A cleanup failure fails the engine only if it loaded (otherwise it already failed)."""
    cleanup_error: str | None = None
    if t.marked:
        try:
            assert registry is not None and t.engine_id is not None
            await asyncio.wait_for(registry.end_update(t.engine_id, loaded=t.loaded, incarnation=t.incarnation),
                                   timeout_s)
        except Exception as exc:
            cleanup_error = f"{type(exc).__name__}: {exc}"
    try:
        await asyncio.wait_for(t.client.resume(), timeout_s)
    except asyncio.TimeoutError:
        cleanup_error = cleanup_error or f"resume: no answer within {timeout_s:g}s"
    except Exception as exc:
        cleanup_error = cleanup_error or f"{type(exc).__name__}: {exc}"
    if cleanup_error is None:
        return
    if t.loaded and t.error is None:
        t.error = cleanup_error
    else:
        log.warning("%s: cleaning up after the failed update failed too: %s", t.url, cleanup_error)


async def catch_up(kind: str, registry: EngineRegistry, path: Path, version: WeightLabel | int, *,
                   max_age_s: float = 30.0,
                   timeout_s: float = 120.0, api_key: str | None = None, adapters: bool = False) -> list[str]:
    """Load `version` (at `path`) into ready engines that serve another version or one nobody can
    name (None: restarted since the trainer's record); their URLs. A fenced engine is tried again
    once its backoff is over.

    Nothing is done when `path` is missing (version 0 is the base model, which has no directory:
    an engine that restarted serves it already)."""
    if not await asyncio.to_thread(Path(path).is_dir):
        return []
    version = WeightLabel.of(version)
    records = await registry.all_weights()
    now = time.time()

    def due(e: EngineInfo) -> bool:
        rec = records.get(e.engine_id)
        return not e.fenced or rec is None or now >= rec.retry_at

    lagging = [e for e in await registry.list(max_age_s=max_age_s)
               if e.ready and e.weights() != version and due(e)]
    if lagging:
        log.info("catching up engine(s) %s to version %s", ", ".join(
            f"{e.url} (serving {'an unknown version' if e.weights() is None else f'v{e.weights()}'}"
            f"{', fenced' if e.fenced else ''})" for e in lagging), version)
        await update_engines(kind, lagging, path, version, registry=registry, timeout_s=timeout_s,
                             include_fenced=True, api_key=api_key, adapters=adapters)
    return [e.url for e in lagging]
