"""Why training stands still: the dominant cause, with its count and its last error.

A job can spin without a sign: every group dropped (a verifier that always raises, an episode
function that always fails, groups all too stale), or none generated at all. The trainer then only
waits. This module turns what the pipeline counts into a verdict (`diagnose`, pure) and keeps the
clock of the last progress (`ProgressWatch`):

- *progress* is a group accepted for training (read fresh into the trainer's buffer) or a step;
- the trainer is *stalled* when no progress was made for `spec.trainer.stallAfterSeconds` and,
  since the last progress, groups were dropped or interrupted (the cause that dropped the most
  leads; ties go to the cause listed first in CAUSES), or no rollout worker held a lease and
  nothing was dropped while some engine is registered (EngineUnreachable when none of them is
  ready, else NoGroupsProduced: workers gone, or out of prompts). Groups still being generated
  with nothing dropped are not a stall, however long they take (long episodes, a slow engine):
  only the deadline below ends that;
- past `spec.trainer.progressDeadlineSeconds` without a step the job fails (ProgressDeadlineExceeded),
  with the verdict in its message.
Both clocks start when the first rollout engine registers: before it, nothing can be generated, and
the job's start-up has its own deadline (spec.startupDeadlineSeconds).

The counts: the rollout workers' job-wide ones in the admission hash (asyncrl/transport/admission.py,
`record_failure`, each with its newest error), and the trainer's own too-stale drops."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from asyncrl.api.status_report import StallReport
from asyncrl.infra.errors import TrainerError
from asyncrl.transport.admission import FAILURE_CAUSES, AdmissionSnapshot

log = logging.getLogger("asyncrl.trainer.stall")

CAUSES: dict[str, tuple[str, str]] = {
    "reward_failures": ("RewardFailures", "groups dropped because their reward could not be computed"),
    "episode_failures": ("EpisodeFailures", "groups dropped because their episode function failed"),
    "generation_failures": ("GenerationFailures", "groups dropped because generation kept failing"),
    "engine_requeues": ("EngineUnreachable", "groups interrupted by an engine that went away (queued again)"),
    "too_stale": ("TooStale", "groups dropped as too stale"),
}
"""Count name -> (the reason a stall of this cause reports, the count in words), in tie-break order."""
NO_GROUPS = "NoGroupsProduced"
"""The reason when nothing was generated and nothing dropped."""


class ProgressDeadlineExceeded(TrainerError):
    """No step for `spec.trainer.progressDeadlineSeconds` (Failed; the message says why)."""

    reason = "ProgressDeadlineExceeded"


@dataclass(frozen=True)
class PipelineCounts:
    """What the pipeline has counted so far, job-wide, and the newest error of each cause."""

    dropped: Mapping[str, int] = field(default_factory=dict)
    """Cause (a CAUSES key) -> groups so far."""
    last_errors: Mapping[str, str] = field(default_factory=dict)
    """Cause -> its newest error text (absent: none known)."""


def pipeline_counts(snap: AdmissionSnapshot, *, too_stale: int, stale_error: str = "") -> PipelineCounts:
    """The rollout workers' counts (admission's) and the trainer's own too-stale drops."""
    return PipelineCounts(dropped={**{c: getattr(snap, c) for c in FAILURE_CAUSES}, "too_stale": too_stale},
                          last_errors={**snap.last_errors, **({"too_stale": stale_error} if stale_error else {})})


def diagnose(now: PipelineCounts, at_progress: PipelineCounts, *, since: float, at: float, running: int,
             engines: int, ready: int) -> StallReport:
    """The stall's report, as if `at - since` seconds without progress were already too long: the
    cause that dropped the most groups since the last progress (`at_progress`); when nothing was
    dropped and no lease is held while `engines` are registered, EngineUnreachable if none of them
    is `ready` (a worker whose engine does not answer takes no lease), else NoGroupsProduced. An
    empty reason: no stall (groups are still being generated, or no rollout has started)."""
    window = {cause: now.dropped.get(cause, 0) - at_progress.dropped.get(cause, 0) for cause in CAUSES}
    window = {cause: n for cause, n in window.items() if n > 0}
    seconds = max(at - since, 0.0)
    if not window:
        if running > 0 or engines == 0:
            return StallReport(since=since, seconds=seconds)
        if ready == 0:
            return StallReport(reason=CAUSES["engine_requeues"][0], since=since, seconds=seconds,
                               message=f"no registered engine is ready ({engines} registered, none answers its "
                                       "rollout worker): nothing is generated")
        return StallReport(reason=NO_GROUPS, since=since, seconds=seconds,
                           message=f"no rollout worker is generating (no admission lease held, nothing dropped; "
                                   f"{ready} of {engines} registered engine(s) ready): the workers stopped or ran "
                                   "out of prompts")
    lead = max(window, key=lambda cause: (window[cause], -list(CAUSES).index(cause)))
    reason, words = CAUSES[lead]
    error = now.last_errors.get(lead, "")
    message = f"{window[lead]} {words}" + (f" (last error: {error})" if error else "")
    others = [f"{n} {CAUSES[c][1]}" for c, n in window.items() if c != lead]
    message += f"; also {', '.join(others)}" if others else ""
    return StallReport(reason=reason, message=message, count=window[lead], last_error=error, since=since,
                       seconds=seconds, dropped=window)


class ProgressWatch:
    """Rank 0's clock of the last progress, and the verdicts drawn from it (see the top)."""

    def __init__(self, *, stall_after_s: float, deadline_s: float | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.stall_after_s = stall_after_s
        self.deadline_s = deadline_s
        self.clock = clock
        self.started = False
        """Whether a rollout engine has registered: until then nothing can be generated (the job's
        RolloutReady condition and startupDeadlineSeconds say why), and neither clock runs."""
        self.last_progress = clock()
        """Unix time of the last accepted group or step (or of the first engine's registration)."""
        self.last_step = self.last_progress
        """Unix time of the last step (or of the first engine's registration): what the deadline counts from."""
        self._kept = 0
        self._at_progress: PipelineCounts | None = None
        self._now = PipelineCounts()
        self._verdict: StallReport | None = None  # diagnose() on the counts last observed (the deadline quotes it)
        self._running = 0  # leases held at the last observation
        self._reported = ""  # the stall reason last reported ("" none): logged when it changes

    def kept(self, groups: int) -> None:
        """The groups trained or buffered now: more than at the last look is progress."""
        if groups > self._kept:
            self.progressed()
        self._kept = groups

    def stepped(self) -> None:
        """A step finished: progress, and the deadline starts again."""
        self.progressed()
        self.last_step = self.clock()

    def progressed(self) -> None:
        self.last_progress = self.clock()
        self._at_progress = self._now

    def observe(self, counts: PipelineCounts, *, running: int, engines: int, ready: int) -> StallReport | None:
        """Take the pipeline's counts now; the stall's report once it has lasted `stall_after_s`
        (None: not stalled). The counts seen when the first engine registers are the baseline (what
        an earlier life counted)."""
        self._now = counts
        if not self.started:
            if engines == 0:
                return None
            self.started = True
            self.last_progress = self.last_step = self.clock()
            self._at_progress = counts
        if self._at_progress is None:
            self._at_progress = counts
        report = diagnose(counts, self._at_progress, since=self.last_progress, at=self.clock(), running=running,
                          engines=engines, ready=ready)
        self._verdict, self._running = report, running
        stalled = report if report.reason and report.seconds >= self.stall_after_s else None
        if (stalled.reason if stalled else "") != self._reported:
            if stalled is not None:
                log.warning("stalled (%s): %s", stalled.reason, stalled.message)
            else:
                log.info("no longer stalled (%s)", self._reported)
            self._reported = stalled.reason if stalled else ""
        return stalled

    def overdue(self) -> ProgressDeadlineExceeded | None:
        """The error that fails the job once `deadline_s` passed without a step (None: not yet, or
        no deadline), with the verdict `observe` drew last."""
        if self.deadline_s is None or not self.started or self._verdict is None:
            return None
        waited = self.clock() - self.last_step
        if waited < self.deadline_s:
            return None
        verdict, running = self._verdict, self._running
        why = verdict.message or (f"{running} group(s) still being generated" if running else "nothing generated")
        return ProgressDeadlineExceeded(f"no training step for {waited:.0f}s (progressDeadlineSeconds="
                                        f"{self.deadline_s:.0f}), no group accepted for {verdict.seconds:.0f}s: "
                                        f"{why}")
