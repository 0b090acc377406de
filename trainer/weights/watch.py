"""Rank 0's watch over the engines: the registry into the report, catch-up of engines behind, and
the job-wide recovery counters (trainer starts, engine restarts and resyncs).

The trainer is the only one that updates engine weights (engine_update.py), so an engine that joined
or restarted since the last publish serves another version until a refresh here loads the
current one into it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from asyncrl.api.status_report import EngineReport
from asyncrl.api.weight_labels import Lineage
from asyncrl.trainer.inbox import StreamIO
from asyncrl.trainer.report.reporter import Reporter
from asyncrl.trainer.weights.engine_update import catch_up
from asyncrl.trainer.weights.files import served_version, weights_path
from asyncrl.transport.recovery import RecoveryCounters

log = logging.getLogger("asyncrl.trainer")

PRUNE_EVERY_S = 60.0
"""How often `refresh` also prunes the registry of long-silent engines."""


class EngineWatch:
    """The engines as rank 0 sees them (no Redis connection: no engines, nothing counted)."""

    def __init__(self, io: StreamIO | None, cfg: Any, *, weight_sync_lag: int, reporter: Reporter, main: bool,
                 lineage: Lineage | None = None):
        self.io = io
        self.lineage = lineage if lineage is not None else Lineage()
        """The trainer's lineage: the label catch-up loads a version under."""
        self.cfg = cfg
        """The trainer's RunConfig: engine protocol, weights dir, waits, API key."""
        self.weight_sync_lag = weight_sync_lag
        self.reporter = reporter
        self.recovery = RecoveryCounters(io.redis, io.admission.names) if io is not None and main else None
        self._incarnations: dict[str, str] = {}  # engine id -> the incarnation last seen in the registry
        self._last_prune = -math.inf

    async def refresh(self, version: int, *, catch_up_engines: bool = True) -> list[Any]:
        """The registered engines, into the report. First (catch_up_engines) load the version served
        for policy `version` into engines that serve another one."""
        if self.io is None:
            return []
        if catch_up_engines:
            await self._catch_up(version)
        try:
            infos = await self.io.registry.list(max_age_s=self.cfg.engine_max_age_s)
            await self.count("engine_restarts", self._new_incarnations(infos))
            if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = time.monotonic()
                if pruned := await self.io.registry.prune(self.cfg.engine_prune_s):
                    log.info("engine registry: removed %d entr%s silent for %.0fs", pruned,
                             "y" if pruned == 1 else "ies", self.cfg.engine_prune_s)
        except Exception as exc:
            log.warning("engine registry unavailable: %s", exc)
            return []
        with self.reporter.edit() as report:  # weight_version: the trainer's record or the worker's newer one
            report.rollout = [EngineReport(url=i.url, weight_version=i.weight_version, ready=i.ready, fenced=i.fenced)
                              for i in infos]
            report.recovery.fenced_engines = sum(1 for i in infos if i.fenced)
        return infos

    async def _catch_up(self, version: int) -> None:
        assert self.io is not None
        cfg = self.cfg
        try:
            served = served_version(version, self.weight_sync_lag)
            path = weights_path(cfg.weights_dir, served).resolve()
            resynced = await catch_up(cfg.engine_kind, self.io.registry, path, self.lineage.label(served),
                                      max_age_s=cfg.engine_max_age_s,
                                      timeout_s=cfg.weight_sync_timeout_s, api_key=cfg.engine_api_key,
                                      adapters=cfg.engine_adapters)
            if resynced:
                await self.count("engine_resyncs", len(resynced))
        except Exception as exc:  # retried at the next refresh; the next publish updates it anyway
            log.warning("engine catch-up failed: %s", exc)

    def _new_incarnations(self, infos: list[Any]) -> int:
        """How many engines came back as a new incarnation since this trainer last looked."""
        came_back = 0
        for info in infos:
            seen = self._incarnations.get(info.engine_id)
            if seen and info.incarnation and info.incarnation != seen:
                came_back += 1
                log.warning("engine %s came back as a new incarnation (%s -> %s)", info.url, seen[:8],
                            info.incarnation[:8])
            if info.incarnation:
                self._incarnations[info.engine_id] = info.incarnation
        return came_back

    async def count_start(self) -> None:
        """Before training: one more trainer start for the job (a restart after the first)."""
        await self.count("trainer_starts", 1)

    async def count(self, field: str, n: int) -> None:
        """Add to a job-wide recovery counter (Redis) and show all of them in the report."""
        if self.recovery is None or n <= 0:
            return
        await self.recovery.add(field, n)
        counts = await self.recovery.read()
        with self.reporter.edit() as report:
            r = report.recovery
            r.trainer_restarts = max(counts.trainer_starts - 1, 0)
            r.engine_restarts, r.engine_resyncs = counts.engine_restarts, counts.engine_resyncs
