"""Trainer checkpoints: everything needed to continue exactly where a committed step left off.

A checkpoint is a directory `step-{N}` holding the model and optimizer state as a
torch.distributed.checkpoint (DCP) of fully-qualified names, each rank writing its own shards
(FSDP) or one copy of what every rank holds (DDP, one process), the RNG states of every rank and
`state.json` (policy version, step, counters, the trainer report, and the ids of the groups
trained in its *window*: the steps since the checkpoint before it). DCP reshards on load, so a
checkpoint resumes at any world size and parallelism. Every rank writes into the same temporary
sibling (the checkpoint directory is on a volume every trainer pod mounts); once all have written,
rank 0 adds state.json and renames it (`asyncrl.infra.files`), so a trainer killed mid-write leaves the
previous checkpoint intact: a directory without state.json is never loaded, and the next
checkpoint removes it.

Exactly once across the commit window. `Trainer.commit` writes the checkpoint, then acknowledges
the window's stream entries (one atomic Lua script: SADD the Redis `trained` set, XACK, XDEL;
asyncrl/transport/streams.py). On resume the checkpoint is authoritative: before reading anything,
the restored window's group ids go through that same ack script (`TrajectoryConsumer.ack_committed`),
which marks them trained and acknowledges this consumer's pending entries that carry them, so they
are never trained again. Wherever a kill lands, Redis and the newest checkpoint agree:
  - before the rename: the newest checkpoint is the previous one, whose window was acknowledged
    (at its own commit, or at the resume from it); the steps since are lost, their entries still
    pending, re-read and trained once in the surviving lineage;
  - after the rename, before the ack: the restart acknowledges the window instead of training it
    again (without this, it re-read its pending entries and trained them twice);
  - during the ack: the script is atomic (also in the AOF), so this is one of the two other cases;
  - during the resume's ack: the same script, redone by the next restart (it is idempotent).

Why the window is enough (bounded memory, incremental state). Invariant, at every instant: (a) the
Redis `trained` set holds no group trained outside the newest checkpoint's lineage (a window is
acknowledged only after its checkpoint is renamed; over-stale groups aside, which the inbox drops
and acknowledges, so marks trained, without training them), and (b) every group of that lineage that Redis does not mark
trained is in the newest checkpoint's window. (b) holds because the ack of window k completes (at
its commit, or at the resume from checkpoint k) before any step of window k+1 is trained, so when
checkpoint k+1 lands only window k+1 can be unacknowledged. So resume needs the newest window's ids
and nothing older: `state.json` holds at most `checkpointInterval x batchSize` ids (not the whole
lineage, ~52 MB per million groups rewritten at every checkpoint), and `groups_trained` keeps the
total. (a state.json of an older version, with every id of the lineage, is read as one big window:
marking already-trained groups trained again is harmless.)

The lineage itself, for audits and the tests that prove at-most-once, is appended, never rewritten:
`trained-groups.jsonl` next to the checkpoints, one line per checkpoint holding its window
(`{"step": n, "window_start_step": m, "group_ids": [...]}`, ~35 bytes per group, on disk only),
written and fsynced just before the checkpoint. Lines of steps after the newest checkpoint belong to
a lost timeline; the resumed trainer cuts them off (`truncate_trained_log`) and `lineage_group_ids`
ignores them, so what it returns is exactly what the newest checkpoint's weights were trained on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.weight_labels import Lineage
from asyncrl.infra.errors import SpecError
from asyncrl.infra.files import atomic_directory, fsync_dir, remove_stray_temp_dirs
from asyncrl.trainer.distributed import DistContext, barrier, broadcast_object, unwrap
from asyncrl.trainer.state.rng_state import load_rng_state, rng_file, save_rng_state

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "state.json"
TRAINED_LOG = "trained-groups.jsonl"
"""The lineage's trained group ids, one line per checkpoint, next to the checkpoints (see the top)."""


@dataclass
class TrainerState:
    """The plain-data part of a checkpoint."""

    step: int = 0
    version: int = 0
    groups_trained: int = 0
    """Every group trained in this lineage (the count; the ids are in TRAINED_LOG)."""
    tokens_trained: int = 0
    dropped: int = 0
    skipped_updates: int = 0
    """Optimizer updates skipped for a non-finite gradient norm in this lineage."""
    window_start_step: int = 0
    """The step of the checkpoint this window follows (the one committed or resumed from last)."""
    window_group_ids: list[str] = field(default_factory=list)
    """Groups trained in steps (window_start_step, step], in order: what this checkpoint's commit
    acknowledges, and what a resume from it acknowledges again (see the top: enough, and bounded)."""
    window_labels: dict[str, int] = field(default_factory=dict)
    """Of the window's groups, how many had tokens of each weight label ("5", "5@1"; the lineage log
    keeps them: which weights the lineage trained on, asyncrl.api.weight_labels)."""
    report: dict[str, Any] = field(default_factory=dict)
    """The TrainerReport at the checkpoint (history, staleness histogram)."""
    timeline: int = 0
    """The trainer timeline of this lineage's newest versions (asyncrl.api.weight_labels; 0 in a
    checkpoint written before timelines existed)."""
    shared_until: dict[str, int] = field(default_factory=dict)
    """Earlier timeline (as a JSON key) -> its last version that is also this lineage's."""
    identity: dict[str, Any] = field(default_factory=dict)
    """What the checkpoint's weights belong to (`model_identity`; {} in one written before it was kept)."""

    def lineage(self) -> Lineage:
        return Lineage(self.timeline, {int(t): int(v) for t, v in self.shared_until.items()})

    def set_lineage(self, lineage: Lineage) -> None:
        self.timeline = lineage.timeline
        self.shared_until = {str(t): v for t, v in lineage.shared_until.items()}

    def start_window(self) -> None:
        """The window is acknowledged (committed, or settled on resume): the next one starts here."""
        self.window_start_step = self.step
        self.window_group_ids = []
        self.window_labels = {}

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "window_group_ids" not in data and "trained_group_ids" in data:
            # written before windows existed: every id of the lineage, a superset of the window
            known["window_group_ids"] = list(data["trained_group_ids"])
        return cls(**known)


class CheckpointMismatchError(SpecError, ValueError):
    """The checkpoint was trained for another model or adapter shape than the job now asks for."""


def model_identity(spec: Any) -> dict[str, Any]:
    """What a checkpoint's weights belong to: the base model, its revision and the LoRA adapter's shape
    (None in full fine-tuning). A resume refuses a checkpoint of another identity: its tensors would
    not fit, or would fit and mean something else."""
    lora = spec.trainer.lora
    return {"model": spec.model.path, "revision": spec.model.revision,
            "lora": None if lora is None else lora.to_wire()}


def check_identity(path: Path, recorded: dict[str, Any], expected: dict[str, Any] | None) -> None:
    """Raise CheckpointMismatchError when the checkpoint at `path` records another identity."""
    if expected is None or not recorded or recorded == expected:
        return
    differ = sorted(k for k in set(recorded) | set(expected) if recorded.get(k) != expected.get(k))
    detail = "; ".join(f"{k}: checkpoint {recorded.get(k)!r}, job {expected.get(k)!r}" for k in differ)
    raise CheckpointMismatchError(f"checkpoint {path} belongs to another model or adapter ({detail}): resume it "
                                  "with the spec that wrote it, or start a new job (another name, or empty "
                                  "checkpoint storage)")


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


def save_checkpoint(root: Path, model: Any, optimizer: Any, state: TrainerState, *, keep: int = 2,
                    ctx: DistContext | None = None) -> Path:
    """Write `step-{state.step}` atomically and keep only the newest `keep` checkpoints; with a
    process group every rank calls this (DCP's save is a collective; `state` is rank 0's).

    An existing directory of the same step (from a lost timeline) is replaced.
    """
    import torch.distributed.checkpoint as dcp
    ctx = ctx or DistContext()
    root = Path(root)
    target = root / f"step-{state.step:06d}"
    # Rank 0 owns the temporary directory (asyncrl.infra.files: fsynced and renamed when the block ends,
    # removed if it raises); the other ranks write into it by the name rank 0 broadcasts.
    with atomic_directory(target) if ctx.is_main else contextlib.nullcontext() as tmp:
        tmp_dir = Path(broadcast_object(str(tmp) if tmp is not None else None, ctx))
        model_state, optim_state = trained_state(model, optimizer)
        with _single_process_quiet():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_dir, no_dist=not ctx.enabled)
        save_rng_state(rng_file(tmp_dir, ctx.rank))
        barrier(ctx)  # (every rank's files are in)
        if ctx.is_main:
            (tmp_dir / STATE_FILE).write_text(json.dumps(state.to_json()))
    if ctx.is_main:
        for _, old in checkpoint_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        remove_stray_temp_dirs(root, "step-")  # temp dirs of a writer that was killed
    barrier(ctx)
    return target


def _read_log(root: Path, up_to_step: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The log's leading complete lines (of steps <= `up_to_step`, when given), and the byte offset
    where they end. Reading stops at a partial or unreadable line (a writer killed mid-line) and at
    the first line past `up_to_step`: lines are in step order."""
    path = Path(root) / TRAINED_LOG
    lines: list[dict[str, Any]] = []
    end = 0
    if not path.exists():
        return lines, end
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            try:
                entry = json.loads(raw)
                entry["step"], entry["group_ids"] = int(entry["step"]), [str(g) for g in entry["group_ids"]]
            except (ValueError, KeyError, TypeError):
                break
            if up_to_step is not None and entry["step"] > up_to_step:
                break
            lines.append(entry)
            end += len(raw)
    return lines, end


def append_trained(root: Path, state: TrainerState) -> None:
    """Append `state`'s window to the lineage log as one line and fsync it: called just before the
    checkpoint of `state` is written, so when that checkpoint exists, so does its line (on disk:
    also after a power cut). A line whose checkpoint never landed is cut off by the next resume."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    line = {"step": state.step, "window_start_step": state.window_start_step, "timeline": state.timeline,
            "labels": dict(state.window_labels), "group_ids": list(state.window_group_ids)}
    path = root / TRAINED_LOG
    new = not path.exists()
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        fsync_dir(root)  # (the file's directory entry)


def truncate_trained_log(root: Path, step: int) -> None:
    """On resume from step `step`: cut off the lines of later steps (a lost timeline) and a partial
    last line. Lines are in step order (each life appends after the step it resumed from), so this
    truncates the file's tail in place, never rewrites it."""
    path = Path(root) / TRAINED_LOG
    if not path.exists():
        return
    _, end = _read_log(root, step)
    if end != path.stat().st_size:
        os.truncate(path, end)


def lineage_group_ids(root: Path, step: int | None = None) -> list[str]:
    """Every group id trained in the lineage of the newest checkpoint under `root` (or of steps up
    to `step`), in training order: the log's lines up to that step. [] without a checkpoint."""
    if step is None:
        latest = latest_checkpoint(root)
        if latest is None:
            return []
        step = read_state(latest).step
    lines, _ = _read_log(root, step)
    return [g for entry in lines for g in entry["group_ids"]]


def lineage_labels(root: Path, step: int) -> dict[str, int]:
    """Of the groups trained in the lineage up to `step`, how many had tokens of each weight label
    (lines written before labels were logged count none)."""
    counts: dict[str, int] = {}
    for entry in _read_log(root, step)[0]:
        for label, n in entry.get("labels", {}).items():
            counts[label] = counts.get(label, 0) + int(n)
    return counts


def read_state(path: Path) -> TrainerState:
    return TrainerState.from_json(json.loads((Path(path) / STATE_FILE).read_text()))


def load_checkpoint(path: Path, model: Any, optimizer: Any, *, device: str = "cpu",
                    ctx: DistContext | None = None, identity: dict[str, Any] | None = None) -> TrainerState:
    """Restore model, optimizer and RNG from `path` into the model as this run wraps it (any world
    size and parallelism: DCP reshards; with a process group every rank calls this, after
    building the optimizer over the wrapped model); returns its TrainerState. `identity`
    (`model_identity`): a checkpoint that records another is refused before anything is loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ctx = ctx or DistContext()
    path = Path(path)
    state = read_state(path)
    check_identity(path, state.identity, identity)
    if (path / LEGACY_MODEL_FILE).exists():
        _load_legacy(path, model, optimizer, device)
    else:
        model_state, optim_state = trained_state(model, optimizer)
        with _single_process_quiet():
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=not ctx.enabled)
        # (not strict: the frozen parameters are the model source's; DCP has already refused a
        # checkpoint that lacks one of the trained ones)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=trained_only(strict=False))
    load_rng_state(path, ctx.rank)
    return state


def trained_only(*, strict: bool = True) -> Any:
    """The state-dict options of a checkpoint: frozen parameters (a LoRA job's base model, which the
    job's model source holds) are left out, so a LoRA checkpoint is the adapter and its optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def trained_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts of what training changes. torch's `ignore_frozen_params` keeps a
    frozen weight that is tied under a second name (the LM head tied to the embeddings), so names of
    frozen parameters, aliases included, are dropped here too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=trained_only())
    frozen = {n for n, p in unwrap(model).named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns at every save and load of one process that it assumes one process: it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


LEGACY_MODEL_FILE = "model.pt"
"""Checkpoints written before DCP: whole state dicts in model.pt and optimizer.pt (and a pickled
rng.pt, which is not loaded: trainer/state/rng_state.py)."""


def _load_legacy(path: Path, model: Any, optimizer: Any, device: str) -> None:
    """A checkpoint of the old layout, into an unsharded model (it holds no shard layout)."""
    from asyncrl.trainer.distributed import is_sharded

    if is_sharded(model):
        raise ValueError(f"{path} is a checkpoint of the layout before sharded checkpoints (model.pt): resume "
                         "it with spec.trainer.parallelism: ddp or on one process; its next checkpoint has "
                         "the new layout")
    unwrap(model).load_state_dict(torch.load(path / LEGACY_MODEL_FILE, map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
