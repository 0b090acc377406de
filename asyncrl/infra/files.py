"""Crash-safe writes: a reader sees the old directory (or file) or the complete new one, never half.

Weights, checkpoints and the converted embedded model are all written this way: into a temporary
sibling (a name starting with "." that readers skip), every file fsynced, renamed over the target,
the parent fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
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


def write_file_atomically(path: Path, text: str) -> None:
    """Replace the file `path` with `text`: a temporary sibling, fsynced, renamed over it, the
    parent fsynced (readers see the old content or the new, never part of it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_directory(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that becomes `target` when the block ends without an error.

    replace=True: an existing `target` is removed first (it belongs to a lost timeline).
    replace=False: an existing `target` wins (another process wrote the same content first).
    A block that raises leaves nothing behind but the exception.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists() and replace:
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if replace or not target.exists():
                raise
            return  # replace=False and another writer got there first: theirs stays
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stray_temp_dirs(parent: Path, name_prefix: str) -> list[Path]:
    """Delete temp dirs that a killed writer left for targets named `name_prefix*` under `parent`."""
    removed = []
    for stray in Path(parent).glob(f".{name_prefix}*-*"):
        if stray.is_dir():
            shutil.rmtree(stray, ignore_errors=True)
            removed.append(stray)
    return removed
