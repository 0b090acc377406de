"""A finished step into the report served at /status (pure: the step's record in, report fields out).

`record` is the step's metrics as `Trainer.train_step` returns them (step_metrics.summarize_step
plus the objective's figures and the draw's); the report shows non-finite figures as 0, because
/status is strict JSON (a step whose loss was not finite had its updates skipped, and
metrics.jsonl's `skipped_updates` says so).
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.status_report import ReplayReport, StepRecord, TrainerReport
from asyncrl.trainer.checkpoint import TrainerState

HISTORY_LIMIT = 500
"""Steps kept in the report's history."""
SHOWN_RATIO_STATS = tuple(f"{prefix}_{stat}" for prefix in ("importance_weight", "full_ratio", "behav_weight")
                          for stat in ("max", "min", "mean")) + ("behav_ess", "behav_kl")
"""Ratio and weight figures of the last step shown in the report."""
LOSS_SHAPE_STATS = ("clip_fraction_low", "clip_fraction_high", "bapo_clip_low", "bapo_clip_high", "vcpo_lr_scale")
"""Loss-shape figures of the last step shown as they are: clipped tokens by side, BAPO's adapted
bounds (0 when off) and VCPO's learning-rate scale."""


def finite_or_zero(value: float) -> float:
    """`value`, or 0.0 when it is NaN or infinite."""
    return value if math.isfinite(value) else 0.0


def step_record(state: TrainerState, record: dict[str, Any], *, wall: float, now: float,
                weight_sync_seconds: float) -> StepRecord:
    """The step's line in the report's history (and the head of its metrics.jsonl line)."""
    return StepRecord(step=state.step, policy_version=state.version, reward_mean=record["reward_mean"],
                      staleness_mean=record["staleness_mean"], staleness_max=record["staleness_max"],
                      loss=finite_or_zero(record["loss"]), clip_fraction=finite_or_zero(record["clip_fraction"]),
                      tokens=record["tokens"], step_seconds=wall, proximal_seconds=record["proximal_seconds"],
                      time=now, zero_signal_groups=record["zero_signal_groups"],
                      weight_sync_seconds=weight_sync_seconds)


def report_step(r: TrainerReport, state: TrainerState, record: dict[str, Any], line: StepRecord, *,
                replay: ReplayReport | None, dead_lettered: int) -> None:
    """Write the finished step (`state` already advanced past it) into the report `r`."""
    shown = {k: finite_or_zero(record[k]) for k in SHOWN_RATIO_STATS}
    r.step, r.policy_version = state.step, state.version
    r.groups_trained, r.tokens_trained = state.groups_trained, state.tokens_trained
    r.tokens_per_second = record["tokens"] / line.step_seconds
    r.reward_mean = record["reward_mean"]
    r.reward_history.append(record["reward_mean"])
    r.staleness.mean, r.staleness.max = record["staleness_mean"], record["staleness_max"]
    r.staleness.dropped, r.staleness.dropped_last_step = state.dropped, record["dropped_step"]
    for lag, n in record["staleness_histogram"].items():
        r.staleness.histogram[str(lag)] = r.staleness.histogram.get(str(lag), 0) + n
    r.clip_fraction = line.clip_fraction
    for key in LOSS_SHAPE_STATS:
        setattr(r, key, finite_or_zero(record.get(key, 0.0)))
    r.tb_beta = record.get("tb_beta")
    if replay is not None:
        r.replay = replay
    for target, prefix in ((r.importance_weight, "importance_weight"),
                           (r.behaviour.full_ratio, "full_ratio"), (r.behaviour.weight, "behav_weight")):
        for stat in ("max", "min", "mean"):
            setattr(target, stat, shown[f"{prefix}_{stat}"])
    r.behaviour.ess, r.behaviour.kl = shown["behav_ess"], shown["behav_kl"]
    r.skipped_updates = state.skipped_updates
    r.zero_signal_fraction = record["zero_signal_fraction"]
    r.dead_lettered = dead_lettered
    r.proximal_seconds, r.step_seconds = record["proximal_seconds"], line.step_seconds
    r.history.append(line)
    del r.history[:-HISTORY_LIMIT]
