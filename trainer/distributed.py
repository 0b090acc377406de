"""torch.distributed for the trainer: one process per device, started by torchrun (or not at all).

Why one module: every rank runs the same training step, but only rank 0 talks to Redis, the
engines and the disk. Rank 0 reads the batch and broadcasts it; all ranks then compute the same
advantages and token counts and train on their shard of it. With `WORLD_SIZE` unset the trainer
runs as a plain single process (world 1, no process group).

Two ways to spread the model (spec.trainer.parallelism):
  fsdp  FSDP2 (`fully_shard` per transformer block, then the root): each rank holds 1/world of the
        parameters, gradients and AdamW state, gathers a block's parameters for its forward and
        backward, and reduce-scatters the gradients. With a model dtype below float32 the sharded
        master copy and the optimizer stay float32, compute runs in the model dtype and gradients
        are reduced in float32 (mixed precision). Every rank must run the same forwards: an
        empty micro-batch still runs one (the loop's `_pad_forward`).
  ddp   every rank holds the whole model and all-reduces gradients once per update (`no_sync`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
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


def wrap_model(model: Any, ctx: DistContext, parallelism: str = "fsdp",
               compute_dtype: torch.dtype | None = None) -> Any:
    """The model as this rank trains it: FSDP2-sharded or DDP across ranks (gradients reduced as
    averages), the bare model on one process. Build the optimizer after this: FSDP2 replaces the
    parameters by their shards. `compute_dtype`: FSDP's compute dtype (the model must be loaded
    in float32 then: that copy is the sharded master); ignored by DDP."""
    if not ctx.enabled:
        return model
    if parallelism == "fsdp":
        return shard_model(model, ctx, compute_dtype)
    if parallelism != "ddp":
        raise ValueError(f"parallelism must be 'fsdp' or 'ddp', got {parallelism!r}")
    if ctx.device.startswith("cuda"):
        return DDP(model, device_ids=[ctx.local_rank])
    return DDP(model)


def transformer_blocks(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes HF says must not be split across
    devices (`_no_split_modules`, e.g. LlamaDecoderLayer): FSDP's units of gather and reshard."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def shard_model(model: Any, ctx: DistContext, compute_dtype: torch.dtype | None = None) -> Any:
    """FSDP2 over all ranks: one unit per transformer block, the rest (embeddings, final norm, a
    tied LM head) in the root unit, which stays gathered from its forward to its backward (so the
    LM head applied outside the forward, trainer/step/logprobs.py, uses whole weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda" if ctx.device.startswith("cuda") else "cpu", (ctx.world_size,))
    policy = MixedPrecisionPolicy() if compute_dtype in (None, torch.float32) else \
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class (_no_split_modules): "
                         "cannot shard it with FSDP; use spec.trainer.parallelism: ddp")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def load_sharded_model(path: str, ctx: DistContext, compute_dtype: torch.dtype | None = None, *,
                       gradient_checkpointing: bool = False, revision: str | None = None,
                       prepare: Callable[[Any], None] | None = None) -> Any:
    """The model FSDP2-sharded across ranks with only rank 0 ever holding it whole: rank 0 loads
    the float32 weights on the CPU, every other rank builds the architecture on the meta device (no
    memory), all shard it, allocate their shards, and rank 0 broadcasts each tensor's shards
    (`set_model_state_dict(broadcast_from_rank0)`) and the buffers a state dict leaves out (e.g. the
    rotary frequencies). Before this every rank loaded the whole float32 model: for a 32B model,
    128 GB of host memory per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from asyncrl.infra.hf_models import load_causal_lm, resolve_model_path

    source = load_causal_lm(path, "float32", "cpu", revision=revision) if ctx.is_main else None
    resolved = resolve_model_path(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolved, revision=revision),
                                                 dtype=torch.float32)
    try:  # what the checkpoint says about generation (the publisher writes it), not the config's defaults
        model.generation_config = GenerationConfig.from_pretrained(resolved, revision=revision or "main")
    except OSError:
        pass
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if prepare is not None:  # (LoRA adapters: rank 0's initial values are the ones broadcast)
        for each in (source, model):
            if each is not None:
                prepare(each)
    model = shard_model(model, ctx, compute_dtype)
    model.to_empty(device=ctx.device)
    set_model_state_dict(model, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if source is not None:
                buffer.copy_(loaded[name])
            dist.broadcast(buffer, src=0)
    del source, loaded
    return model


def is_sharded(model: Any) -> bool:
    """True for an FSDP2 model (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def runs_own_forward(model: Any) -> bool:
    """True when the model's own forward must run for every use (DDP prepares its all-reduce there;
    FSDP gathers the root's parameters there): trainer/step/logprobs.py then captures the hidden states."""
    return unwrap(model) is not model or is_sharded(model)


def unwrap(model: Any) -> Any:
    """The underlying module: for the HF attributes a DDP wrapper hides (`base_model_prefix`, the
    LM head: trainer/step/logprobs.py). An FSDP2 model is its own module."""
    return getattr(model, "module", model)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor-sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor is gathered (a collective: every rank calls it), a plain one is itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(model: Any, max_norm: float) -> float:
    """Clip the gradients to `max_norm` in place; the total norm before clipping, as a float (the
    same on every rank: FSDP's shard norms are reduced, DDP's gradients are already identical)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(full_tensor(norm))


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
    """DDP's no_sync() for all but the last micro-batch of a minibatch (one all-reduce per update).
    FSDP reduce-scatters every micro-batch: its gradients stay sharded instead of whole."""
    if ctx.enabled and not sync and isinstance(model, DDP):
        return model.no_sync()
    return contextlib.nullcontext()
