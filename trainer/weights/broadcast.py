"""Collective weight sync: the trainer's rank 0 broadcasts each version to every engine at once.

With `trainer.weightTransport: collective`, step 3 of a weight update (engine_update.py: the engines
are paused) is one broadcast instead of every engine reading the version from the shared volume:

  - the group: rank 0 is this process, ranks 1..N the engines (each SGLang engine takes
    `engine_ranks` ranks, one per tensor-parallel worker). It is formed when the engines to update
    differ from its members (first publish, an engine joined, restarted, failed or left): rank 0
    hosts the rendezvous at `address:port` while every engine is asked, concurrently, to
    `init_weights_update_group` (rollout/engines/weight_group.py; the name is new for every group, so an
    engine never mistakes a stale group for the current one);
  - the broadcast: the version's safetensors files (files.py wrote them: rank 0 reads them back
    from its page cache, and a lagged engine gets exactly the version it is told to serve) go out
    in buckets of at most `bucket_bytes`, one `update_weights_from_distributed` request per engine
    per bucket, the last one carrying the version label; the engine answers once it has loaded it;
  - failure: whatever fails (an engine that does not join, answers an error, dies mid-broadcast or
    times out) the group is closed and never reused, and the engines it did not load are returned
    to the caller, which loads them from disk. Disk is also how an engine that joins late or
    restarts first gets the current weights (weight_sync.catch_up); it joins the group at the next
    publish. After a group could not be formed, publishes use disk for `retry_after_s` instead of
    paying the join timeout each time.

vLLM engines stay on disk: vLLM 0.32 has its own NCCL weight transfer (/init_weight_transfer_engine,
/update_weights, ...), another protocol that we do not speak yet; the spec refuses collective with vllm.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.weight_labels import WeightLabel
from asyncrl.rollout.engines.base import Engine
from asyncrl.rollout.engines.weight_group import TensorSpec, close_group, open_group, send
from asyncrl.trainer.weights.files import BUCKET_BYTES, plan_buckets

log = logging.getLogger("asyncrl.trainer.weights.broadcast")

RETRY_AFTER_S = 300.0


@dataclass(frozen=True)
class GroupMember:
    """One paused engine, as the broadcast sees it: who it is (engine id and server life) and a client."""

    url: str
    engine_id: str
    incarnation: str
    client: Engine = field(compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return self.engine_id, self.incarnation


@dataclass
class _Group:
    name: str
    handle: Any
    members: frozenset[tuple[str, str]]


@dataclass
class CollectiveStats:
    """What the status report and the logs say about collective sync."""

    groups_formed: int = 0
    versions_broadcast: int = 0
    disk_fallbacks: int = 0
    """Engine updates that fell back to disk (the group could not be formed or the broadcast failed)."""
    last_error: str = ""


class CollectiveSync:
    """Rank 0's side of the weight group (one per trainer process; rank 0 only)."""

    def __init__(self, *, address: str, port: int, backend: str, engine_ranks: int = 1, timeout_s: float = 120.0,
                 bucket_bytes: int = BUCKET_BYTES, device: str | torch.device = "cpu",
                 retry_after_s: float = RETRY_AFTER_S):
        self.address, self.port, self.backend = address, port, backend
        self.engine_ranks = max(1, engine_ranks)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.retry_after_s = retry_after_s
        self.stats = CollectiveStats()
        self._group: _Group | None = None
        self._life = uuid.uuid4().hex[:8]  # group names of another trainer life never collide with ours
        self._retry_at = 0.0

    @property
    def group_name(self) -> str | None:
        return self._group.name if self._group else None

    async def sync(self, members: Sequence[GroupMember], path: Path, version: WeightLabel) -> dict[str, str]:
        """Load `path` (version `version`) into the paused `members`; the URLs not loaded, with why."""
        if not members:
            return {}
        errors: dict[str, str]
        if time.monotonic() < self._retry_at:
            errors = {m.url: f"collective sync is off for {self._retry_at - time.monotonic():.0f}s more after: "
                             f"{self.stats.last_error}" for m in members}
        else:
            try:
                group = await self._ensure(members)
            except Exception as exc:
                self._retry_at = time.monotonic() + self.retry_after_s
                errors = {m.url: f"the weight group could not be formed: {exc}" for m in members}
            else:
                errors = await self._broadcast(group, members, path, version)
                if errors:
                    await self.close(members)  # it may be mid-broadcast on some rank: never reused
                else:
                    self.stats.versions_broadcast += 1
        if errors:
            self.stats.disk_fallbacks += len(errors)
            self.stats.last_error = "; ".join(f"{url}: {why}" for url, why in errors.items())
        return errors

    async def close(self, reachable: Sequence[GroupMember] = ()) -> None:
        """Close the current group: the engines among `reachable` leave it, then this side."""
        group, self._group = self._group, None
        if group is None:
            return
        leaving = [m for m in reachable if m.key in group.members]
        results = await asyncio.gather(*(asyncio.wait_for(m.client.destroy_weight_group(group.name), self.timeout_s)
                                         for m in leaving), return_exceptions=True)
        for m, result in zip(leaving, results):
            if isinstance(result, BaseException):
                log.info("%s: leaving weight group %s: %s", m.url, group.name, result)
        try:
            await asyncio.wait_for(asyncio.to_thread(close_group, group.handle), self.timeout_s)
        except Exception as exc:  # a peer died mid-collective: the handle is abandoned, the name never reused
            log.warning("closing weight group %s: %s", group.name, exc)

    async def _ensure(self, members: Sequence[GroupMember]) -> _Group:
        """The group of exactly `members`: the current one, or a new one (the old one closed)."""
        keys = frozenset(m.key for m in members)
        if self._group is not None and self._group.members == keys:
            return self._group
        await self.close(members)
        self.stats.groups_formed += 1
        name = f"asyncrl-{self._life}-{self.stats.groups_formed}"
        world = 1 + self.engine_ranks * len(members)
        host = asyncio.to_thread(open_group, self.address, self.port, 0, world, group_name=name,
                                 backend=self.backend, timeout_s=self.timeout_s)
        joins = [m.client.init_weight_group(self.address, self.port, 1 + i * self.engine_ranks, world, name,
                                            self.backend) for i, m in enumerate(members)]
        results = await asyncio.gather(*(asyncio.wait_for(step, self.timeout_s + 5.0) for step in (host, *joins)),
                                       return_exceptions=True)
        handle, joined = results[0], results[1:]
        failed = {m.url: r for m, r in zip(members, joined) if isinstance(r, BaseException)}
        if isinstance(handle, BaseException) or failed:
            if not isinstance(handle, BaseException):
                await asyncio.to_thread(close_group, handle)
            await asyncio.gather(*(m.client.destroy_weight_group(name) for m in members if m.url not in failed),
                                 return_exceptions=True)
            why = "; ".join(f"{url}: {_describe(r)}" for url, r in failed.items())
            if isinstance(handle, BaseException):
                why = why or _describe(handle)
            raise RuntimeError(f"group {name} ({world} ranks at {self.address}:{self.port}): {why}")
        self._group = _Group(name, handle, keys)
        log.info("weight group %s formed: rank 0 and %d engine(s) (%s over %s)", name, len(members),
                 ", ".join(m.url for m in members), self.backend)
        return self._group

    async def _broadcast(self, group: _Group, members: Sequence[GroupMember], path: Path,
                         version: WeightLabel) -> dict[str, str]:
        """Every bucket to every member; stops at the first failure (the group is then unusable)."""
        buckets = await asyncio.to_thread(plan_broadcast, Path(path), self.bucket_bytes)
        if not buckets:
            return {m.url: f"{path} has no *.safetensors files" for m in members}
        for i, bucket in enumerate(buckets):
            named = await asyncio.to_thread(load_bucket, bucket, self.device)
            specs = [TensorSpec.of(name, t) for name, t in named]
            label = version if i == len(buckets) - 1 else None
            steps = [asyncio.to_thread(send, group.handle, [t for _, t in named]),
                     *(m.client.update_weights_from_group(specs, group.name, label) for m in members)]
            try:
                results = await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), self.timeout_s)
            except asyncio.TimeoutError:
                return {m.url: f"bucket {i + 1}/{len(buckets)} not loaded within {self.timeout_s:g}s"
                        for m in members}
            sent = results[0]
            if isinstance(sent, BaseException):
                return {m.url: f"broadcast of bucket {i + 1}/{len(buckets)} failed: {_describe(sent)}"
                        for m in members}
            failed = {m.url: f"bucket {i + 1}/{len(buckets)}: {_describe(r)}"
                      for m, r in zip(members, results[1:]) if isinstance(r, BaseException)}
            if failed:  # the others loaded part of the version: they go to disk too
                return {m.url: failed.get(m.url, "another engine failed the broadcast") for m in members}
        return {}


def plan_broadcast(path: Path, bucket_bytes: int) -> list[list[tuple[Path, str]]]:
    """The tensors of the version directory `path` as buckets of (file, name), in file order, each
    at most `bucket_bytes` (one larger tensor is a bucket of its own); sizes come from the headers."""
    from safetensors import safe_open

    entries: list[tuple[Path, str]] = []
    sizes: list[int] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for name in list(handle.keys()):
                entries.append((f, name))
                sizes.append(_nbytes(handle, name))
    return [[entries[j] for j in bucket] for bucket in plan_buckets(sizes, bucket_bytes)]


def load_bucket(bucket: Sequence[tuple[Path, str]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """One bucket's tensors on `device` (a just-written version is read from the page cache)."""
    from safetensors import safe_open

    out: list[tuple[str, torch.Tensor]] = []
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for f, name in bucket:
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            out.append((name, opened[f].get_tensor(name).to(device)))
    return out


def _nbytes(handle: Any, name: str) -> int:
    sl = handle.get_slice(name)
    count = 1
    for dim in sl.get_shape():
        count *= int(dim)
    return count * _DTYPE_BYTES.get(sl.get_dtype(), 4)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
"""Bytes per element of safetensors' dtype names (bucket sizes come from the headers, not the data)."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}"
