"""Publishing a new policy version: weights on disk, an event, every engine updated.

Order matters. The weights directory `weights/v{N}` is written into a temporary sibling and
renamed, so an engine never sees half a model. Then the version event goes out (rollout workers
learn where the weights are), then every engine registered for the job is paused, told to load
`v{N}` and resumed, all concurrently and each under a timeout; a failure names the server.
Only then does admission learn the new version (which opens capacity for new rollouts).
Directories no engine uses any more are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncrl.trainer.publish")

_VERSION_DIR = re.compile(r"^v(\d+)$")


class WeightSyncError(RuntimeError):
    """One or more engines failed to pause, load or resume; the message names each server."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        detail = "; ".join(f"{url}: {err}" for url, err in failures.items())
        super().__init__(f"weight update failed on {len(failures)} engine(s): {detail}")


def weights_path(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


def write_weights(model: Any, tokenizer: Any, weights_dir: Path, version: int) -> Path:
    """Write an HF safetensors directory for `version` atomically (temp dir, fsync, rename)."""
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    target = weights_path(weights_dir, version)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=weights_dir))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():  # left by a run that crashed after writing it (a lost timeline)
            shutil.rmtree(target)
        os.rename(tmp, target)
        _fsync_dir(weights_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def published_versions(weights_dir: Path) -> list[int]:
    """Versions with a complete directory under `weights_dir`, ascending."""
    out = []
    if Path(weights_dir).is_dir():
        for p in Path(weights_dir).iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
    return sorted(out)


def prune_weights(weights_dir: Path, keep: set[int], *, newest: int) -> list[int]:
    """Delete version directories older than `newest` that are not in `keep`; also stray temp dirs."""
    removed = []
    for v in published_versions(weights_dir):
        if v != newest and v not in keep and v < newest:
            shutil.rmtree(weights_path(weights_dir, v), ignore_errors=True)
            removed.append(v)
    for p in Path(weights_dir).glob(".v*-*"):
        if p.is_dir() and time.time() - p.stat().st_mtime > 600:
            shutil.rmtree(p, ignore_errors=True)
    return removed


def drop_versions_after(weights_dir: Path, version: int) -> list[int]:
    """On (re)start: directories newer than the checkpoint belong to a lost timeline, and temp
    dirs are half-written versions of a killed writer (only this process writes here); remove both."""
    removed = [v for v in published_versions(weights_dir) if v > version]
    for v in removed:
        shutil.rmtree(weights_path(weights_dir, v), ignore_errors=True)
    for stray in Path(weights_dir).glob(".v*-*"):
        if stray.is_dir():
            shutil.rmtree(stray, ignore_errors=True)
    return removed


@dataclass
class SyncResult:
    seconds: float
    engines: int


async def _update_one(kind: str, url: str, path: str, version: int) -> None:
    from asyncrl.rollout.engines import make_engine

    engine = make_engine(kind, url)
    try:
        await engine.pause(mode="abort")
        try:
            await engine.update_weights(path, version)
        finally:
            await engine.resume()  # never leave a server paused, even when the load failed
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            res = close()
            if asyncio.iscoroutine(res):
                await res


async def update_engines(kind: str, urls: list[str], path: Path, version: int,
                         *, timeout_s: float = 120.0) -> SyncResult:
    """Pause -> update_weights -> resume every engine concurrently; raise naming the failures."""
    start = time.perf_counter()

    async def one(url: str) -> tuple[str, str | None]:
        try:
            await asyncio.wait_for(_update_one(kind, url, str(path), version), timeout_s)
            return url, None
        except asyncio.TimeoutError:
            return url, f"no answer within {timeout_s:.0f}s"
        except Exception as exc:  # noqa: BLE001 - reported with the server's url
            return url, f"{type(exc).__name__}: {exc}"

    results = await asyncio.gather(*(one(u) for u in urls))
    failures = {url: err for url, err in results if err is not None}
    if failures:
        raise WeightSyncError(failures)
    return SyncResult(seconds=time.perf_counter() - start, engines=len(urls))
