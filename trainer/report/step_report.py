"""A finished step into the report served at /status (pure: the step's record in, report fields out).

The report shows non-finite figures as 0, because /status is strict JSON (a step whose loss was
not finite had its updates skipped, and metrics.jsonl, which keeps the raw values, says so).
"""

from __future__ import annotations

import math

from asyncrl.api.status_report import StepMetrics, StepRecord, TrainerReport
from asyncrl.trainer.state.checkpoint import TrainerState

HISTORY_LIMIT = 500
"""Steps kept in the report's history."""


def finite_or_zero(value: float) -> float:
    """`value`, or 0.0 when it is NaN or infinite."""
    return value if math.isfinite(value) else 0.0


def shown(metrics: StepMetrics) -> StepMetrics:
    """`metrics` with every non-finite float as 0."""
    return metrics.model_copy(update={k: finite_or_zero(v) for k, v in metrics if isinstance(v, float)})


def report_step(r: TrainerReport, state: TrainerState, metrics: StepMetrics, *, dead_lettered: int) -> None:
    """Write the finished step (`state` already advanced past it) into the report `r`."""
    r.step, r.policy_version = state.step, state.version
    r.groups_trained, r.tokens_trained = state.groups_trained, state.tokens_trained
    r.reward_history.append(metrics.reward_mean)
    r.staleness.dropped = state.dropped
    for lag, n in metrics.staleness_histogram.items():
        r.staleness.histogram[lag] = r.staleness.histogram.get(lag, 0) + n
    for source, n in metrics.groups_by_source.items():
        r.groups_by_source[source] = r.groups_by_source.get(source, 0) + n
    r.skipped_updates = state.skipped_updates
    r.dead_lettered = dead_lettered
    r.last_step = shown(metrics)
    r.history.append(StepRecord.model_validate(r.last_step.model_dump()))
    del r.history[:-HISTORY_LIMIT]
