"""Publishing a policy version: its weights written (atomically), the engines brought onto it.

Every rank takes part in writing (a sharded model is gathered; rank 0 writes); rank 0 then sends
the version event, updates the engines (disk or the collective weight group), tells admission the
new version, prunes weight directories no engine serves, and asks for an evaluation when one is due.
An engine whose update fails is fenced and reported, and training goes on; weights holding NaN or
Inf are never published: they end training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

import torch

from asyncrl.api.spec import AsyncRLJobSpec
from asyncrl.api.weight_labels import Lineage
from asyncrl.infra.errors import TrainerError
from asyncrl.infra.hf_models import torch_dtype
from asyncrl.trainer import distributed as D
from asyncrl.trainer.evaluation import Evaluations
from asyncrl.trainer.inbox import StreamIO
from asyncrl.trainer.report.reporter import Reporter
from asyncrl.trainer.weights.broadcast import CollectiveSync
from asyncrl.trainer.weights.engine_update import WeightSyncError, update_engines
from asyncrl.trainer.weights.files import prune_weights, retained_versions, served_version, weights_path, write_weights
from asyncrl.trainer.weights.watch import EngineWatch
from asyncrl.transport.versions import VersionEvent

log = logging.getLogger("asyncrl.trainer")


class NonFiniteWeightsError(TrainerError, RuntimeError):
    """The updated weights hold NaN or Inf: they are not published and training ends (Failed)."""

    reason = "NonFiniteWeights"


class TrainerFailed(TrainerError):
    """A fatal error that one rank (rank 0: weight sync) saw, re-raised on every other rank."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


def failure_reason(exc: BaseException) -> str:
    """The CamelCase reason of a fatal trainer error (its `reason`, else its class name)."""
    return str(getattr(exc, "reason", "") or type(exc).__name__)


def non_finite_parameters(model: Any, ctx: D.DistContext | None = None, limit: int = 5) -> list[str]:
    """Names of (up to `limit`) parameters holding NaN or Inf; [] when all are finite. With a
    process group every rank calls this and gets the same verdict (a sharded model's NaN may sit
    in another rank's shard: then it is named as such).

    One fp32 sum per tensor (~20 ms for 135M parameters on one CPU core): NaN and Inf survive a sum.
    """
    params = [(n, D.local_tensor(p.detach())) for n, p in D.unwrap(model).named_parameters()]
    sums = torch.stack([p.sum(dtype=torch.float32) for _, p in params])
    bad = [] if bool(torch.isfinite(sums).all()) else \
        [n for n, p in params if not bool(torch.isfinite(p).all())][:limit]
    if ctx is not None and ctx.enabled and D.all_reduce_max([float(bool(bad))], ctx)[0] and not bad:
        return ["(in another rank's shard)"]
    return bad


def refuse_non_finite_weights(model: Any, ctx: D.DistContext, step: int) -> None:
    """Raise NonFiniteWeightsError when the weights after `step` hold NaN or Inf (every rank: the
    weights are identical on every rank after the update, so every rank decides the same)."""
    if bad := non_finite_parameters(model, ctx):
        raise NonFiniteWeightsError(f"non-finite weights after step {step} (not published): {', '.join(bad)}")


async def on_every_rank(publish: Awaitable[None], ctx: D.DistContext) -> None:
    """Await `publish` on every rank; a fatal error only rank 0 saw (weight sync) is broadcast and
    raised on every rank, so no rank is left waiting in a collective for a rank that stopped."""
    if not ctx.enabled:
        await publish
        return
    failure: TrainerError | None = None
    try:
        await publish
    except TrainerError as exc:  # (only rank 0 publishes)
        failure = exc
    verdict = D.broadcast_object(None if failure is None else (failure_reason(failure), str(failure)), ctx)
    if failure is not None:
        raise failure
    if verdict is not None:
        raise TrainerFailed(*verdict)


class Publisher:
    """Writes versions and brings the engines onto them (the trainer's RunConfig says where and how)."""

    def __init__(self, spec: AsyncRLJobSpec, cfg: Any, ctx: D.DistContext, model: Any, tokenizer: Any, *,
                 io: StreamIO | None, collective: CollectiveSync | None, reporter: Reporter, engines: EngineWatch,
                 evaluations: Evaluations, lineage: Lineage | None = None):
        self.spec, self.cfg, self.ctx = spec, cfg, ctx
        self.lineage = lineage if lineage is not None else Lineage()
        """The trainer's lineage: the label each version is loaded into the engines under."""
        self.model, self.tokenizer = model, tokenizer
        self.io, self.collective = io, collective
        self.reporter, self.engines, self.evaluations = reporter, engines, evaluations
        self.sync_failures = 0
        self.last_seconds = 0.0
        """How long the last `publish` took (writing the weights and updating the engines)."""

    async def publish(self, version: int, *, write: bool = True) -> None:
        """Every rank: weights/v{version} (a sharded model is gathered: every rank takes part, rank 0
        writes); then rank 0: version event, engines updated, admission told."""
        self.reporter.set_phase("Publishing", f"publishing version {version}")
        t0 = time.perf_counter()
        if write:
            write_weights(self.model, self.tokenizer, self.cfg.weights_dir, version,
                          dtype=torch_dtype(self.spec.model.dtype), ctx=self.ctx)
        if not self.ctx.is_main:
            return
        lag = self.spec.trainer.weight_sync_lag
        sync_error, engines = await self._sync_engines(version) if self.io is not None else (None, [])
        keep = {e.weight_version for e in engines} - {None}  # versions engines still serve
        prune_weights(self.cfg.weights_dir, keep | retained_versions(version, lag), newest=version)
        self.last_seconds = time.perf_counter() - t0
        with self.reporter.edit() as report:
            report.policy_version = version
            if self.collective is not None:
                report.weight_sync_disk_fallbacks = self.collective.stats.disk_fallbacks
            if sync_error:
                report.message = sync_error
        if self.evaluations.due(version):  # (its weights are out: the engines serve it, or catch up)
            await self.evaluations.request(version)

    async def _sync_engines(self, version: int) -> tuple[str | None, list[Any]]:
        """Rank 0: the version event, the engines' update (of the served version, with
        trainer.weightSyncLag an older one), admission's version; returns the sync error shown in
        the report (None when all went well) and the engines as the registry now has them."""
        assert self.io is not None
        cfg = self.cfg
        served = served_version(version, self.spec.trainer.weight_sync_lag)
        served_path = weights_path(cfg.weights_dir, served)
        sync_error = None
        path = weights_path(cfg.weights_dir, version).resolve()
        await self.io.versions.publish(VersionEvent(version=version, weights_path=str(path), time=time.time()))
        engines = await self.io.registry.list(max_age_s=cfg.engine_max_age_s)
        if engines and (served == version or served_path.is_dir()):  # (lagged v0: the base model)
            try:
                await update_engines(cfg.engine_kind, engines, served_path.resolve(), self.lineage.label(served),
                                     registry=self.io.registry, timeout_s=cfg.weight_sync_timeout_s,
                                     api_key=cfg.engine_api_key, collective=self.collective,
                                     adapters=cfg.engine_adapters)
            except WeightSyncError as exc:  # the failing engines are fenced: training goes on
                self.sync_failures += 1
                sync_error = str(exc)
                log.error("%s; fenced %s (retried by catch-up; %d failed sync(s) in this run)",
                          exc, ", ".join(exc.fenced) or "none", self.sync_failures)
        await self.io.admission.set_version(version)
        engines = await self.engines.refresh(version, catch_up_engines=False)  # failed ones: at the next refresh
        ready = [e for e in engines if e.ready]
        if ready and all(e.fenced for e in ready):  # waits (no crash loop) and says so
            sync_error = (f"all {len(ready)} ready engine(s) are fenced after failed weight updates; "
                          f"rollout waits until catch-up loads version {served} into one: "
                          + "; ".join(f"{e.url}: {e.fenced}" for e in ready))
            log.error("%s", sync_error)
        return sync_error, engines
