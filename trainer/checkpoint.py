"""Trainer checkpoints: everything needed to continue exactly where a committed step left off.

A checkpoint is a directory `step-{N}` holding the model and optimizer state dicts, the RNG
states and `state.json` (policy version, step, counters, the trainer report, the ids of every group
this lineage has trained). It is written into a temporary sibling and renamed (`asyncrl.files`), so a
trainer killed mid-write leaves the previous checkpoint intact. The trainer acknowledges stream entries only
after the checkpoint that contains their update is on disk: after a crash, the entries trained
since are still pending, are re-read and trained again on the restored weights, so in the
surviving lineage every group counts at most once and no acknowledged group is lost.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.files import atomic_directory, remove_stray_temp_dirs

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "state.json"


@dataclass
class TrainerState:
    """The plain-data part of a checkpoint."""

    step: int = 0
    version: int = 0
    groups_trained: int = 0
    tokens_trained: int = 0
    dropped: int = 0
    skipped_updates: int = 0
    """Optimizer updates skipped for a non-finite gradient norm in this lineage."""
    trained_group_ids: list[str] = field(default_factory=list)
    """Every group id trained in this lineage, in order (how tests prove at-most-once)."""
    report: dict[str, Any] = field(default_factory=dict)
    """The TrainerReport at the checkpoint (history, staleness histogram)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    out = []
    if Path(root).is_dir():
        for p in Path(root).iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / STATE_FILE).exists():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1][1] if dirs else None


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, model: Any, optimizer: Any, state: TrainerState, *, keep: int = 2) -> Path:
    """Write `step-{state.step}` atomically and keep only the newest `keep` checkpoints.

    An existing directory of the same step (from a lost timeline) is replaced.
    """
    root = Path(root)
    target = root / f"step-{state.step:06d}"
    with atomic_directory(target) as tmp:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps(state.to_json()))
    for _, old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    remove_stray_temp_dirs(root, "step-")  # temp dirs of a writer that was killed
    return target


def read_state(path: Path) -> TrainerState:
    return TrainerState.from_json(json.loads((Path(path) / STATE_FILE).read_text()))


def load_checkpoint(path: Path, model: Any, optimizer: Any, *, device: str = "cpu") -> TrainerState:
    """Restore model, optimizer and RNG from `path`; returns its TrainerState."""
    path = Path(path)
    model.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return read_state(path)
