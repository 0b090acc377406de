"""A process group between the trainer's rank 0 and the rollout engines, outside torch's default world.

Collective weight sync (trainer.weightTransport: collective) broadcasts each version from the
trainer (rank 0 of this group) to every engine (ranks 1..N). The engines are separate servers with
their own default process group (SGLang's tensor parallelism), so this group is built the way the
pinned SGLang builds its `init_weights_update_group` group, and both sides must agree on every
detail for NCCL or gloo to connect:

  - a TCP rendezvous at tcp://master_address:master_port, whose store rank 0 hosts;
  - the store wrapped in a PrefixStore named after the group, so several groups can share a port;
  - torch's group constructor with that name and no global ranks (the group is its own world);
  - one `broadcast` per tensor, from rank 0, in the order of the request's `names`.

The constructor and the rank map are torch internals: SGLang uses the same two, which is what
makes our side interoperate with it; `open_group` is the one place that touches them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("nccl", "gloo")
GROUP_NAME = "weight_update_group"
"""SGLang's default group name; ours carry a generation suffix (a rebuilt group never reuses a name)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast as the engine's request names it (SGLang: names, dtypes, shapes)."""

    name: str
    dtype: str
    """torch's attribute name: "bfloat16", "float32" (SGLang does `getattr(torch, dtype)`)."""
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    def empty(self, device: str | torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=parse_dtype(self.dtype), device=device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a request names; ValueError names the bad value."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as bfloat16 or float32)")
    return dtype


def open_group(master_address: str, master_port: int, rank: int, world_size: int, *, group_name: str,
               backend: str, timeout_s: float) -> Any:
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks joined.

    Raises on a bad argument, or when the others do not arrive within `timeout_s`."""
    from torch.distributed import distributed_c10d as c10d

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world size {world_size}")
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name), timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # its own world: rank i is i
    return group


def close_group(group: Any) -> None:
    """Release the group (its sockets, and the store when this is rank 0)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def send(group: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0: broadcast `tensors` in order (the receivers allocate them from the same TensorSpecs)."""
    import torch.distributed as dist

    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def receive(group: Any, specs: Sequence[TensorSpec], device: str | torch.device) -> list[torch.Tensor]:
    """Ranks > 0: the tensors rank 0 broadcasts for `specs`, in order."""
    import torch.distributed as dist

    tensors = [spec.empty(device) for spec in specs]
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()
    return tensors
