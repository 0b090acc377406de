"""Publishing a new policy version on disk: the weights directory and its housekeeping.

`weights/v{N}` is an HF safetensors directory (config, tokenizer, and the weights in files of at
most `bucket_bytes`, with the HF index when there are several), or with spec.trainer.lora a PEFT
adapter directory (trainer/lora.py), written atomically
(asyncrl.infra.files.atomic_directory: a temporary sibling, fsynced, renamed), so an engine never sees
half a model. A sharded (FSDP) model is gathered one bucket at a time, every rank joining the
gathers and rank 0 writing: rank 0's memory grows by one bucket, never by a whole model.
What follows the write, in trainer/loop.py `Trainer.publish`: the version event goes out,
trainer/weights/engine_update.py updates every engine, admission learns the version, and directories no
engine uses any more are deleted here (`prune_weights`).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from asyncrl.infra.files import atomic_directory, remove_stray_temp_dirs
from asyncrl.infra.peft_adapters import has_adapters
from asyncrl.trainer.distributed import DistContext, full_tensor, is_sharded, unwrap
from asyncrl.trainer.lora import write_adapter

_VERSION_DIR = re.compile(r"^v(\d+)$")
BUCKET_BYTES = 1 << 30
"""Default size of one weights file, and of what rank 0 holds at once while publishing (1 GiB)."""
INDEX_FILE = "model.safetensors.index.json"


def weights_path(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


def write_weights(model: Any, tokenizer: Any, weights_dir: Path, version: int, *, dtype: torch.dtype | None = None,
                  ctx: DistContext | None = None, bucket_bytes: int = BUCKET_BYTES) -> Path | None:
    """Write an HF safetensors directory for `version` atomically (tensors cast to `dtype`, default:
    as they are); a leftover `v{version}` (from a run that crashed after writing it: a lost
    timeline) is replaced. For a sharded model every rank must call this (the gathers are
    collectives); rank 0 writes and gets the path, the others None. A model with LoRA adapters
    (spec.trainer.lora) publishes the adapter alone, as a PEFT directory (trainer/lora.py)."""
    if has_adapters(unwrap(model)):
        return write_adapter(model, weights_path(weights_dir, version), dtype=dtype, ctx=ctx)
    tensors = published_tensors(model)
    files = bucket_files(plan_buckets([_nbytes(t, dtype) for _, t in tensors], bucket_bytes))
    if ctx is not None and not ctx.is_main:
        if is_sharded(model):
            for _, t in tensors:
                full_tensor(t)  # (rank 0 keeps what it gathers; the others only take part)
        return None
    from safetensors.torch import save_file

    target = weights_path(weights_dir, version)
    weight_map: dict[str, str] = {}
    with atomic_directory(target, replace=True) as tmp:
        for name, rows in files:
            bucket = {tensors[i][0]: _exported(tensors[i][1], dtype) for i in rows}
            save_file(bucket, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, name))
            del bucket
        if len(files) > 1:
            total = sum(_nbytes(t, dtype) for _, t in tensors)
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True))
        _write_configs(unwrap(model), tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return target


def published_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict as HF saves it: persistent entries by name, a tensor tied to an
    earlier one (the LM head tied to the embeddings) left out, as transformers leaves it out."""
    seen: set[int] = set()
    out = []
    for name, t in unwrap(model).state_dict(keep_vars=True).items():  # (tied: the same Parameter)
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices whose sizes add up to at most `bucket_bytes` (a larger one alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        buckets.append(current)
    return buckets


def bucket_files(buckets: list[list[int]]) -> list[tuple[str, list[int]]]:
    """HF's file names: `model.safetensors` alone, `model-0000i-of-0000n.safetensors` for several."""
    if len(buckets) <= 1:
        return [("model.safetensors", buckets[0] if buckets else [])]
    n = len(buckets)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", rows) for i, rows in enumerate(buckets)]


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def _exported(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole tensor on the CPU, in `dtype`, contiguous (what safetensors writes)."""
    return full_tensor(t).detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()


def _write_configs(model: Any, path: Path, dtype: torch.dtype | None) -> None:
    """The model's config (its dtype: the one written) and generation config, as HF saves them."""
    config = copy.deepcopy(model.config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
        generation.save_pretrained(path)


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
