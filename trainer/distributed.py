"""torch.distributed for the trainer: one process per device, started by torchrun (or not at all).

Why one module: every rank runs the same training step, but only rank 0 talks to Redis, the
engines and the disk. Rank 0 reads the batch and broadcasts it; all ranks then compute the same
advantages and token counts, train on their shard, and DDP sums the gradients. With
`WORLD_SIZE` unset the trainer runs as a plain single process (world 1, no process group).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class DistContext:
    """Where this process sits in the trainer's process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str | None = None
    object_group: Any = None
    """A gloo group for Python-object broadcasts (NCCL cannot carry them on CPU tensors)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str) -> str:
    """`auto` means CUDA when a GPU is visible, else CPU."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device is 'cuda' but no CUDA device is visible")
        return "cuda"
    return "cpu"


def init_distributed(requested_device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if world <= 1:
        return DistContext(device=device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    object_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                       backend=backend, object_group=object_group)


def wrap_model(model: Any, ctx: DistContext) -> Any:
    """DDP across ranks (gradients all-reduced as averages), the bare model on one process."""
    if not ctx.enabled:
        return model
    if ctx.device.startswith("cuda"):
        return DDP(model, device_ids=[ctx.local_rank])
    return DDP(model)


def unwrap(model: Any) -> Any:
    """The underlying module: for saving weights and state dicts, and for the HF attributes a DDP
    wrapper hides (`base_model_prefix`, the LM head: trainer/logprobs.py)."""
    return getattr(model, "module", model)


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (pickled; fine for a batch of trajectory groups)."""
    if not ctx.enabled:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.object_group)
    return box[0]


def _all_reduce(values: list[float], ctx: DistContext, op: str) -> list[float]:
    """Reduce a few floats over ranks in float64 (on the GPU for NCCL, which has no CPU path)."""
    if not ctx.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if ctx.backend == "nccl":
        t = t.to(ctx.device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return [float(x) for x in t.cpu().tolist()]


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum a few floats over ranks (step metrics)."""
    return _all_reduce(values, ctx, "SUM")


def all_reduce_max(values: list[float], ctx: DistContext) -> list[float]:
    """Maximum of a few floats over ranks (min via negation)."""
    return _all_reduce(values, ctx, "MAX")


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier(group=ctx.object_group)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def no_sync_unless(model: Any, sync: bool, ctx: DistContext) -> Any:
    """DDP's no_sync() for all but the last micro-batch of a minibatch (one all-reduce per update)."""
    if ctx.enabled and not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
