"""Publishing a new policy version on disk: the weights directory and its housekeeping.

`weights/v{N}` is an HF safetensors directory (with the tokenizer), written atomically
(asyncrl.files.atomic_directory: a temporary sibling, fsynced, renamed), so an engine never sees
half a model. What follows the write, in trainer/loop.py `Trainer.publish`: the version event goes
out, trainer/weight_sync.py updates every engine, admission learns the version, and directories no
engine uses any more are deleted here (`prune_weights`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from asyncrl.files import atomic_directory, remove_stray_temp_dirs

_VERSION_DIR = re.compile(r"^v(\d+)$")


def weights_path(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


def write_weights(model: Any, tokenizer: Any, weights_dir: Path, version: int) -> Path:
    """Write an HF safetensors directory for `version` atomically; a leftover `v{version}` (from a
    run that crashed after writing it: a lost timeline) is replaced."""
    target = weights_path(weights_dir, version)
    with atomic_directory(target, replace=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return target


def served_version(version: int, lag: int) -> int:
    """The version the engines are told to load when `version` is published: `lag` older
    (spec.trainer.weightSyncLag, a staleness-study knob), never below the base model's 0."""
    return max(version - lag, 0)


def retained_versions(version: int, lag: int) -> set[int]:
    """Versions publish keeps besides those engines serve: the newest, the one before it, and back
    to `version - lag`, the one lagged engines are told to load (and a restarted one catches up to)."""
    return set(range(max(version - max(lag, 1), 0), version + 1))


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
    """Delete version directories older than `newest` that are not in `keep`."""
    removed = []
    for v in published_versions(weights_dir):
        if v < newest and v not in keep:
            shutil.rmtree(weights_path(weights_dir, v), ignore_errors=True)
            removed.append(v)
    return removed


def drop_versions_after(weights_dir: Path, version: int) -> list[int]:
    """On (re)start: directories newer than the checkpoint belong to a lost timeline, and temp
    dirs are half-written versions of a killed writer (only this process writes here); remove both."""
    removed = [v for v in published_versions(weights_dir) if v > version]
    for v in removed:
        shutil.rmtree(weights_path(weights_dir, v), ignore_errors=True)
    remove_stray_temp_dirs(Path(weights_dir), "v")
    return removed
