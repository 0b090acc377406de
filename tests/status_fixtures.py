"""A synthetic TrainerReport of a job 30 steps in, for the status endpoint and dashboard tests."""

from __future__ import annotations

import math
import time

from asyncrl.status_report import (EngineReport, ImportanceWeightReport, StalenessReport, StepRecord,
                                   TrainerReport)


def synthetic_report(steps: int = 30) -> TrainerReport:
    now = time.time()
    history = [StepRecord(step=s, policy_version=s, reward_mean=0.05 + 0.3 * (1 - math.exp(-s / 10)),
                          staleness_mean=1.0 + 0.5 * math.sin(s), staleness_max=2, loss=0.01 * s,
                          tokens=2000, step_seconds=20.0, proximal_seconds=0.001, time=now - 20 * (steps - s))
               for s in range(1, steps + 1)]
    return TrainerReport(
        job="demo", phase="Training", step=steps, policy_version=steps, max_steps=100,
        groups_trained=8 * steps, tokens_trained=2000 * steps, tokens_per_second=100.0,
        reward_mean=history[-1].reward_mean, reward_history=[h.reward_mean for h in history],
        staleness=StalenessReport(mean=1.25, max=2, limit=2, dropped=3, histogram={"0": 500, "1": 900, "2": 300}),
        clip_fraction=0.02, importance_weight=ImportanceWeightReport(max=3.5, min=0.2, mean=1.01),
        proximal_seconds=0.001, step_seconds=20.0, weight_sync_seconds=0.8,
        rollout=[EngineReport(url="http://10.0.0.7:30000", weight_version=steps - 1, ready=True)],
        history=history, started_at=now - 600, updated_at=now)
