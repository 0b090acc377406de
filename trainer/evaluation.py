"""Rank 0's side of held-out evaluation (spec.evaluation): ask, collect, and wait for the last one.

The rollout workers evaluate (rollout/evaluation); the trainer asks for versions 0, N, 2N, ... and
the final one, each right after it was published, reads the results into the report, metrics.jsonl,
the log and the trackers, and after the last step waits (phase Evaluating) up to
`finalTimeoutSeconds` for the final version's result before the run succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncrl.api.spec import EvaluationSpec
from asyncrl.api.status_report import EvalRecord
from asyncrl.trainer.inbox import EvalInbox, merge_evaluations
from asyncrl.trainer.report.metrics_file import append_eval_line
from asyncrl.trainer.report.reporter import Reporter, TrackerSink

log = logging.getLogger("asyncrl.trainer")

EVAL_HISTORY_LIMIT = 500
"""Evaluations kept in the report (one per policy version, the newest versions)."""
FINAL_EVAL_POLL_S = 0.5
"""While waiting for the final evaluation, re-read the results (and check for a stop) this often."""
ENGINE_REFRESH_S = 5.0
"""While rank 0 waits (for a batch, for the final evaluation): refresh the engines (and read the results) this often."""


class Evaluations:
    """Asks for evaluations of published versions and collects their results (rank 0)."""

    def __init__(self, inbox: EvalInbox | None, evaluation: EvaluationSpec | None, *, max_steps: int,
                 reporter: Reporter, metrics_path: Path | None, trackers: TrackerSink | None):
        self.inbox = inbox
        self.evaluation = evaluation
        self.max_steps = max_steps
        self.reporter = reporter
        self.metrics_path = metrics_path
        self.trackers = trackers

    def due(self, version: int) -> bool:
        """Versions 0, N, 2N, ... (N = evaluation.everySteps) and the final one are evaluated."""
        evaluation = self.evaluation
        return evaluation is not None and (version % evaluation.every_steps == 0 or version >= self.max_steps)

    async def request(self, version: int) -> None:
        """Ask the rollout workers to evaluate `version` (already published); asking twice is a no-op."""
        if self.inbox is not None and await self.inbox.request(version):
            log.info("asked for a held-out evaluation of policy version %d", version)

    async def poll(self, step: int) -> list[EvalRecord]:
        """Read the results that arrived into the report; each new one also goes to metrics.jsonl,
        the log and the trackers (at trainer step `step`). Returns the new ones."""
        if self.inbox is None:
            return []
        read, new = await self.inbox.read()
        if not read:
            return []
        with self.reporter.edit() as report:
            report.evaluations = merge_evaluations(report.evaluations, read, EVAL_HISTORY_LIMIT)
        for r in new:
            if self.metrics_path is not None:
                append_eval_line(self.metrics_path, step, r)
            pass_at_k = f" pass@{r.k} {r.pass_at_k:.3f}" if r.pass_at_k is not None else ""
            log.info("eval v%d (step %d): reward %.3f pass@1 %.3f%s, %d prompts x %d, %.0f%% on version, "
                     "%.1fs on %s", r.policy_version, step, r.reward_mean, r.pass_at_1, pass_at_k, r.prompts, r.k,
                     100 * r.on_version, r.seconds, r.engine_id or "?")
            if self.trackers is not None:
                self.trackers.log_eval(step, r)
        return new

    def evaluated(self, version: int) -> bool:
        with self.reporter.reading() as report:
            return any(r.policy_version == version for r in report.evaluations)

    async def await_final(self, version: int, step: int, *, stop_requested: Callable[[], bool],
                          refresh_engines: Callable[[], Awaitable[Any]]) -> None:
        """After the last step: wait (phase Evaluating) until the final `version`'s result arrives,
        `finalTimeoutSeconds` pass (a warning: the job still succeeds) or a stop is asked."""
        if self.inbox is None or self.evaluation is None:
            return
        timeout = self.evaluation.final_timeout_seconds
        await self.request(version)  # (asked at its publish already, unless that life was cut short)
        await self.poll(step)
        if self.evaluated(version):
            return
        if timeout <= 0:
            log.info("not waiting for the evaluation of the final policy version %d (finalTimeoutSeconds=0)",
                     version)
            return
        self.reporter.set_phase("Evaluating", f"waiting up to {timeout}s for the held-out evaluation of the final "
                                              f"policy version {version}")
        log.info("waiting up to %ds for the held-out evaluation of the final policy version %d", timeout, version)
        deadline = time.monotonic() + timeout
        last_refresh = time.monotonic()
        while not self.evaluated(version):
            if stop_requested():
                log.warning("stop requested: not waiting any longer for the evaluation of policy version %d",
                            version)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("no held-out evaluation of the final policy version %d after %ds "
                            "(evaluation.finalTimeoutSeconds); finishing without it", version, timeout)
                return
            await asyncio.sleep(min(FINAL_EVAL_POLL_S, left))
            if time.monotonic() - last_refresh > ENGINE_REFRESH_S:
                await refresh_engines()
                last_refresh = time.monotonic()
            await self.poll(step)
        log.info("final policy version %d evaluated", version)
