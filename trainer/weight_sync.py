"""Weight sync: the trainer is the one owner of every rollout engine's weights.

After publish.py wrote `weights/v{N}` and the version event went out, `update_engines` updates
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
on each answer, or for an engine without labels the record above; see rollout/worker.py). So the trainer also owns
`catch_up`: an engine that joined or restarted since the last publish (its registered version is
not the policy version, or is unknown: a restarted server the trainer's record no longer
describes) gets the current version from the weights volume before its worker serves rollout
on it, as it would have at the next publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.errors import TrainerError
from asyncrl.rollout.engines import make_engine
from asyncrl.rollout.engines.base import EngineError
from asyncrl.transport.versions import EngineInfo, EngineRegistry

log = logging.getLogger("asyncrl.trainer.weight_sync")

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


async def update_engines(kind: str, engines: Sequence[EngineInfo | str], path: Path, version: int, *,
                         registry: EngineRegistry | None = None, timeout_s: float = 120.0,
                         include_fenced: bool = False, api_key: str | None = None) -> SyncResult:
    """Update every ready engine to `version` (steps 1-5 above), concurrently; raise naming the failures.

    `engines`: registry entries (not ready ones, and fenced ones unless `include_fenced`, are left
    out); a bare URL is updated without a record (nothing to label by). A registry entry that
    fails is fenced (`WeightSyncError.fenced`). `api_key`: the engines' --api-key, sent as a bearer token.
    """
    start = time.perf_counter()
    chosen = [e for e in engines if isinstance(e, str) or (e.ready and (include_fenced or not e.fenced))]
    skipped = tuple(e.url for e in engines if not isinstance(e, str) and e not in chosen)

    async def one(engine: EngineInfo | str) -> tuple[str, str | None]:
        url, engine_id = (engine, None) if isinstance(engine, str) else (engine.url, engine.engine_id)
        incarnation = None if isinstance(engine, str) else engine.incarnation
        try:
            await asyncio.wait_for(_update_one(kind, url, engine_id, incarnation, str(path), version, registry,
                                               timeout_s, api_key), timeout_s)
            return url, None
        except asyncio.TimeoutError:
            return url, f"no answer within {timeout_s:g}s"
        except Exception as exc:  # reported with the server's url
            error = f"{type(exc).__name__}: {exc}"
            if registry is not None and engine_id is not None and unreachable(exc):
                try:
                    await registry.remove(engine_id)
                    error += " (unregistered until its worker's next heartbeat)"
                except Exception as remove_exc:
                    log.warning("%s: could not unregister the unreachable engine: %s", url, remove_exc)
            return url, error

    results = await asyncio.gather(*(one(e) for e in chosen))
    failures = {url: err for url, err in results if err is not None}
    if failures:
        fenced = []
        for engine in chosen:
            if isinstance(engine, str) or engine.url not in failures or registry is None:
                continue
            try:
                await registry.fence(engine.engine_id, failures[engine.url], backoff_s=FENCE_BACKOFF_S,
                                     backoff_max_s=FENCE_BACKOFF_MAX_S)
                fenced.append(engine.engine_id)
            except Exception as exc:  # Redis down: the next push tries it again, nothing worse
                log.warning("%s: could not fence the failing engine: %s", engine.url, exc)
        raise WeightSyncError(failures, fenced=fenced, updated=len(chosen) - len(failures))
    return SyncResult(seconds=time.perf_counter() - start, engines=len(chosen), skipped=skipped)


def unreachable(exc: BaseException) -> bool:
    """Whether nothing answered at the engine's address (refused, unresolvable, or no connection in time)."""
    import httpx

    cause = exc.__cause__ if isinstance(exc, EngineError) else exc
    return isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout))


async def _update_one(kind: str, url: str, engine_id: str | None, incarnation: str | None, path: str,
                      version: int, registry: EngineRegistry | None, timeout_s: float,
                      api_key: str | None = None) -> None:
    """One engine: mark, pause, load, record, resume (the adapter's HTTP timeout bounds each call)."""
    engine = make_engine(kind, url, timeout=timeout_s, api_key=api_key)
    loaded = False
    try:
        if registry is not None and engine_id is not None:
            await registry.begin_update(engine_id, version, timeout_s)
        try:
            await engine.pause(mode="abort")
            await engine.update_weights(path, version)
            loaded = True
        finally:  # also after a failed or timed-out pause/load: clear the mark, never leave a server paused
            cleanup_error: Exception | None = None
            if registry is not None and engine_id is not None:
                try:
                    await registry.end_update(engine_id, loaded=loaded, incarnation=incarnation)  # (step 4)
                except Exception as exc:
                    cleanup_error = exc
            try:
                await engine.resume()
            except Exception as exc:
                cleanup_error = cleanup_error or exc
            if cleanup_error is not None:
                if loaded:
                    raise cleanup_error
                log.warning("%s: cleaning up after the failed update failed too: %s", url, cleanup_error)
    finally:
        await engine.close()


async def catch_up(kind: str, registry: EngineRegistry, path: Path, version: int, *, max_age_s: float = 30.0,
                   timeout_s: float = 120.0, api_key: str | None = None) -> list[str]:
    """Load `version` (at `path`) into ready engines that serve another version or one nobody can
    name (None: restarted since the trainer's record); their URLs. A fenced engine is tried again
    once its backoff is over.

    Nothing is done when `path` is missing (version 0 is the base model, which has no directory:
    an engine that restarted serves it already)."""
    if not await asyncio.to_thread(Path(path).is_dir):
        return []
    records = await registry.all_weights()
    now = time.time()

    def due(e: EngineInfo) -> bool:
        rec = records.get(e.engine_id)
        return not e.fenced or rec is None or now >= rec.retry_at

    lagging = [e for e in await registry.list(max_age_s=max_age_s)
               if e.ready and e.weight_version != version and due(e)]
    if lagging:
        log.info("catching up engine(s) %s to version %d", ", ".join(
            f"{e.url} (serving {'an unknown version' if e.weight_version is None else f'v{e.weight_version}'}"
            f"{', fenced' if e.fenced else ''})" for e in lagging), version)
        await update_engines(kind, lagging, path, version, registry=registry, timeout_s=timeout_s,
                             include_fenced=True, api_key=api_key)
    return [e.url for e in lagging]
