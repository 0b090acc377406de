"""One step's figures: accumulated per micro-batch, reduced over ranks (report/metrics_file.py writes them).

Means are token-weighted sums over this rank's micro-batches, summed over ranks and divided once
(so they do not depend on how the batch was cut): loss-mask stats by `tokens`, behaviour-weight
stats by `kept_tokens`, the padding fraction by positions fed to the model, and the behaviour
ESS is formed from those sums, not averaged. The loss is the sum of the micro-batch losses (each
already normalised by its whole minibatch) averaged over the minibatches. Staleness, rewards and
lengths come from the broadcast batch, so they are identical on every rank without a reduction.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from asyncrl.api.status_report import StepMetrics
from asyncrl.trainer import distributed as D
from asyncrl.trainer.step.batch import TrainBatch
from asyncrl.trainer.step.losses import BAPO_STAT_KEYS, STAT_KEYS
from asyncrl.trainer.step.plan import TrainSequence

KEPT_STATS = ("behav_weight_mean", "behav_weight_sq_mean")
"""Stats of `policy_loss` over the kept tokens: step means weighted by `kept_tokens`."""
EXTREMES = ("importance_weight", "full_ratio", "behav_weight")
"""`policy_loss`'s `<name>_max`/`<name>_min` pairs: step max and min over micro-batches and ranks."""
_EXTREME_KEYS = tuple(f"{name}_{stat}" for name in EXTREMES for stat in ("max", "min"))
LOSS_STATS = tuple(k for k in (*STAT_KEYS, *BAPO_STAT_KEYS) if k in StepMetrics.model_fields and k != "loss"
                   and k not in (*KEPT_STATS, *_EXTREME_KEYS, "tokens", "behav_ess", "staleness_mean", "staleness_max"))
"""Stats of `policy_loss` that are step figures, over the loss mask: token-weighted step means (BAPO's
bounds are chosen per micro-batch, docs/algorithms.md, so the step reports their token-weighted mean;
0 with fixed bounds). The ESS is formed from the step's sums, and the staleness from the batch."""
MEANS = ("loss", *LOSS_STATS, *KEPT_STATS, "entropy", "padding_fraction")
"""Everything summed over ranks, in this order (the same list on every rank)."""
STEP_LOSS_KEYS = (*(k for k in MEANS if k in StepMetrics.model_fields and k != "padding_fraction"),
                  *_EXTREME_KEYS, "behav_ess")
"""The step record's figures from the loss (and entropy)."""


@dataclass
class StepStats:
    """Sums and extremes accumulated over micro-batches (and then over ranks), and the step's timers."""

    sums: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    """One per optimizer update (minibatch)."""
    started: float = field(default_factory=time.perf_counter)
    proximal_seconds: float = 0.0
    """`recompute`'s forward pass, plus the log-linear proximal's time inside the loss (`proximal_s`)."""

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        if not math.isnan(value):
            self.sums[key] += value * weight
            self.sums[key + "#w"] += weight

    def extreme(self, key: str, value: float) -> None:
        if not math.isnan(value):
            self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            self.mins[key] = min(self.mins.get(key, math.inf), value)

    def add_micro_batch(self, loss: Tensor, loss_stats: dict[str, float], entropy: Tensor, batch: TrainBatch) -> None:
        """Fold in one micro-batch: its loss, `policy_loss`'s stats (weighted by its tokens), entropy."""
        ntok = float(batch.num_tokens)
        self.sums["loss"] += float(loss.detach())
        self.sums["loss#w"] += 1.0
        self.proximal_seconds += float(loss_stats.get("proximal_s", 0.0))
        kept = float(loss_stats.get("kept_tokens", ntok))
        for key in LOSS_STATS:
            if key in loss_stats:
                self.add(key, float(loss_stats[key]), ntok)
        for key in KEPT_STATS:
            if key in loss_stats:
                self.add(key, float(loss_stats[key]), kept)
        for name in EXTREMES:
            # an empty selection reports 0 for its max and min: not an extreme
            if (kept if name == "behav_weight" else ntok) and f"{name}_max" in loss_stats:
                self.extreme(name, float(loss_stats[f"{name}_max"]))
                self.extreme(name, float(loss_stats[f"{name}_min"]))
        if ntok:
            self.add("entropy", float(entropy[batch.loss_mask].mean()), ntok)

    def add_fed(self, positions: int, tokens: int) -> None:
        """Fold in what a micro-batch fed the model: `positions`, `tokens` of them sequence tokens
        (the rest padding). The step's `padding_fraction` is padding / positions over all ranks."""
        if positions:
            self.add("padding_fraction", (positions - tokens) / positions, positions)

    def reduce(self, ctx: D.DistContext) -> dict[str, float]:
        """Means, ratio extremes, the behaviour ESS and proximal seconds over all ranks (collective)."""
        n = len(MEANS)
        summed = D.all_reduce_sum([self.sums[k] for k in MEANS] + [self.sums[k + "#w"] for k in MEANS]
                                  + [self.proximal_seconds], ctx)
        values = {k: summed[i] / summed[n + i] if summed[n + i] else 0.0 for i, k in enumerate(MEANS)}
        # (each micro-batch loss is already normalised by its whole minibatch, so they add up)
        values["loss"] = summed[0] / max(len(self.grad_norms), 1)
        # ESS = (sum w)^2 / (n sum w^2) = mean_w^2 / mean_w2 over every kept token of the step
        mean_w, mean_w2 = values["behav_weight_mean"], values["behav_weight_sq_mean"]
        values["behav_ess"] = mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0
        # max and -min in one collective (a rank that saw nothing sends -inf); 1.0, the on-policy
        # ratio, when no rank saw anything
        extremes = D.all_reduce_max([x for name in EXTREMES for x in (self.maxes.get(name, -math.inf),
                                                                      -self.mins.get(name, math.inf))], ctx)
        for i, name in enumerate(EXTREMES):
            hi, neg_lo = extremes[2 * i], extremes[2 * i + 1]
            values[f"{name}_max"], values[f"{name}_min"] = (hi, -neg_lo) if math.isfinite(hi) else (1.0, 1.0)
        values["proximal_seconds"] = summed[-1] / ctx.world_size
        return values


def summarize_step(stats: StepStats, seqs: list[TrainSequence], groups: list[Any], *, step: int, version: int,
                   ctx: D.DistContext) -> StepMetrics:
    """The step's figures from its micro-batches, its fresh sequences and their groups (collective);
    the loop adds the updates', the objective's, the draw's and the clock's (`Trainer.finish_step`)."""
    values = stats.reduce(ctx)
    reward_by_source, groups_by_source = source_figures(groups)
    lags = staleness_counts(seqs, version)
    n_tokens = sum(lags.values())
    rewards = [s.reward for s in seqs]
    return StepMetrics.model_validate({
        "step": step, "policy_version": version, **{k: values[k] for k in STEP_LOSS_KEYS},
        "grad_norm": float(np.mean(stats.grad_norms)) if stats.grad_norms else 0.0,
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "response_length": float(np.mean([len(s.response_ids) for s in seqs])) if seqs else 0.0,
        "tokens": int(sum(int(s.trained().sum()) for s in seqs)),
        "masked_tokens": int(sum(int((~s.trained()).sum()) for s in seqs)),
        "staleness_mean": (sum(k * v for k, v in lags.items()) / n_tokens) if n_tokens else 0.0,
        "staleness_max": max(lags) if lags else 0,
        "staleness_histogram": {str(lag): n for lag, n in sorted(lags.items())},
        "reward_by_source": reward_by_source, "groups_by_source": groups_by_source, **episode_figures(groups),
        "proximal_seconds": values["proximal_seconds"], "padding_fraction": values["padding_fraction"],
        "compute_seconds": time.perf_counter() - stats.started})


def source_figures(groups: list[Any]) -> tuple[dict[str, float], dict[str, int]]:
    """(mean reward over the samples, groups) per mixture source of `groups` (TrajectoryGroups);
    both empty when no group names a source (a job with one dataset)."""
    rewards: defaultdict[str, list[float]] = defaultdict(list)
    for g in groups:
        if g.source:
            rewards[g.source].extend(float(s.reward) for s in g.samples)
    counts = Counter(g.source for g in groups if g.source)
    return ({k: float(np.mean(v)) if v else 0.0 for k, v in sorted(rewards.items())},
            {k: counts[k] for k in sorted(counts)})


def episode_figures(groups: list[Any]) -> dict[str, float | int]:
    """Turns, tool calls and time of the multi-turn episodes among `groups` (all 0 for single answers)."""
    stats = [s.episode for g in groups for s in g.samples if s.episode is not None]
    if not stats:
        return {}
    return {"turns_mean": float(np.mean([e.turns for e in stats])), "tool_calls": sum(e.tool_calls for e in stats),
            "tool_errors": sum(e.tool_errors for e in stats),
            "tool_seconds": float(np.mean([e.tool_seconds for e in stats])),
            "generate_seconds": float(np.mean([e.generate_seconds for e in stats]))}


def staleness_counts(seqs: list[TrainSequence], version: int) -> Counter[int]:
    """Trained tokens per version lag; a token newer than `version` (after a resume) counts as lag 0."""
    counts: Counter[int] = Counter()
    for s in seqs:
        trained = s.versions[s.trained()] if len(s.versions) else s.versions
        lags = np.clip(version - trained[trained >= 0], 0, None) if len(trained) else np.array([])
        counts.update(int(x) for x in lags)
    return counts
