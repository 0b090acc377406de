"""Chaos (issue 15): the job's components as separate processes, SIGKILLed on a seeded schedule and
restarted as kubelet would; from Redis and the final checkpoint: nothing lost, nothing trained twice,
admission without drift, no long stall, and the job finishes. The harness is benchmarks/chaos.py
(its long version is the benchmark in docs/benchmarks.md); this is its short version.

Stated bound on a stall (the longest stretch without a new policy version): 90 s. A restart here
takes ~11 s (the trainer: start-up, model, resume); the failures this guards against stalled for
20-240 s (a killed worker's leases until they expired, a restarted engine's base-model groups
dropped until the trainer re-published).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import chaos

STALL_BOUND_S = 90.0


def test_the_schedule_kills_every_kind_before_any_twice_at_rising_versions():
    for seed in range(5):
        plan = chaos.plan_kills(seed, 14, 40)
        kinds = [k for _, k in plan]
        assert sorted(kinds[:6]) == sorted(chaos.KINDS) and sorted(kinds[6:12]) == sorted(chaos.KINDS)
        versions = [v for v, _ in plan]
        assert versions == sorted(versions) and versions[0] >= 1 and versions[-1] <= 34
    assert chaos.plan_kills(0, 14, 40) == chaos.plan_kills(0, 14, 40) != chaos.plan_kills(1, 14, 40)
    assert chaos.plan_kills(0, 0, 40) == []


@pytest.mark.slow
def test_every_component_killed_the_job_loses_nothing_trains_nothing_twice_and_finishes(tmp_path: Path):
    cfg = chaos.ChaosConfig(seed=0, kills=len(chaos.KINDS), max_steps=30, timeout_s=480)
    result = chaos.run_chaos(tmp_path / "run", cfg, chaos.write_tiny_model(tmp_path / "tiny-model"))
    log = "\n".join(result.log)
    assert result.kills == dict(Counter(chaos.KINDS)), log  # each kind once
    assert result.restarts.get("redis") == 1 and result.restarts.get("trainer", 0) >= 3, log
    assert result.finished and result.steps == 30, log
    assert (result.lost, result.twice, result.final_drift) == (0, 0, 0), log
    assert result.foreign == 0, log  # no group trained on weights outside the final lineage
    assert result.trained == 30 * cfg.batch_size, log  # the final lineage: every step's batch, once
    assert result.longest_stall_s < STALL_BOUND_S, log
