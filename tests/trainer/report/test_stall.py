"""A stall's verdict (trainer/report/stall.py): the dominant cause since the last accepted group, with
its count and last error; when nothing is generated, NoGroupsProduced; no stall while groups are
still being generated; the progress deadline's error."""

from __future__ import annotations

import pickle

import pytest

from asyncrl.trainer.report.stall import (
    NO_GROUPS,
    PipelineCounts,
    ProgressDeadlineExceeded,
    ProgressWatch,
    diagnose,
    pipeline_counts,
)
from asyncrl.transport.admission import AdmissionSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counts(**dropped: int) -> PipelineCounts:
    return PipelineCounts(dropped=dropped, last_errors={c: f"{c} error" for c in dropped})


def test_the_cause_that_dropped_most_since_the_last_progress_leads_with_its_last_error():
    before = counts(reward_failures=100, too_stale=1)  # (what an earlier stretch dropped does not count)
    now = counts(reward_failures=112, too_stale=3, episode_failures=0)
    report = diagnose(now, before, since=1000.0, at=1075.0, running=2, engines=1, ready=1)
    assert (report.reason, report.count, report.seconds, report.since) == ("RewardFailures", 12, 75.0, 1000.0)
    assert report.last_error == "reward_failures error"
    assert report.dropped == {"reward_failures": 12, "too_stale": 2}
    assert report.message == ("12 groups dropped because their reward could not be computed (last error: "
                              "reward_failures error); also 2 groups dropped as too stale")


@pytest.mark.parametrize(("window", "reason"), [
    ({"too_stale": 4}, "TooStale"),
    ({"episode_failures": 1}, "EpisodeFailures"),
    ({"generation_failures": 2, "engine_requeues": 2}, "GenerationFailures"),  # a tie: the one listed first
    ({"engine_requeues": 3, "reward_failures": 1}, "EngineUnreachable"),
])
def test_each_cause_has_its_reason(window: dict[str, int], reason: str):
    assert diagnose(counts(**window), counts(), since=0.0, at=90.0, running=0, engines=1, ready=1).reason == reason


def test_nothing_dropped_is_a_stall_only_when_no_group_is_being_generated():
    idle = diagnose(counts(), counts(), since=0.0, at=90.0, running=0, engines=2, ready=2)
    assert idle.reason == NO_GROUPS and "no rollout worker is generating" in idle.message
    assert "2 of 2 registered engine(s) ready" in idle.message
    # a worker whose engine does not answer takes no lease: nothing runs, nothing is dropped
    down = diagnose(counts(), counts(), since=0.0, at=90.0, running=0, engines=2, ready=0)
    assert down.reason == "EngineUnreachable"
    assert down.message.startswith("no registered engine is ready (2 registered")
    slow = diagnose(counts(), counts(), since=0.0, at=900.0, running=3, engines=2, ready=2)
    assert slow.reason == ""  # slow, not stuck
    assert diagnose(counts(), counts(), since=0.0, at=900.0, running=0, engines=0, ready=0).reason == ""  # no rollout


def test_the_watch_reports_after_its_bound_and_forgets_on_progress():
    clock = Clock()
    watch = ProgressWatch(stall_after_s=60, deadline_s=None, clock=clock)
    assert watch.observe(counts(reward_failures=5), running=1, engines=1, ready=1) is None  # the baseline
    clock.now += 59
    assert watch.observe(counts(reward_failures=9), running=1, engines=1, ready=1) is None  # not yet
    clock.now += 2
    stalled = watch.observe(counts(reward_failures=12), running=1, engines=1, ready=1)
    assert stalled is not None and (stalled.reason, stalled.count, stalled.seconds) == ("RewardFailures", 7, 61.0)
    watch.kept(1)  # a group was accepted: the window starts again from the counts last seen
    clock.now += 30
    assert watch.observe(counts(reward_failures=20), running=1, engines=1, ready=1) is None
    clock.now += 31
    stalled = watch.observe(counts(reward_failures=20), running=1, engines=1, ready=1)
    assert stalled is not None and stalled.count == 8
    watch.kept(1)  # the same number of groups kept is not progress
    assert watch.observe(counts(reward_failures=20), running=1, engines=1, ready=1) is not None


def test_the_deadline_counts_from_the_last_step_and_says_why():
    clock = Clock()
    watch = ProgressWatch(stall_after_s=60, deadline_s=300, clock=clock)
    watch.observe(counts(), running=1, engines=1, ready=1)
    clock.now += 200
    watch.kept(2)  # accepted groups are not a step
    clock.now += 99
    assert watch.overdue() is None
    clock.now += 1
    watch.observe(counts(reward_failures=3), running=1, engines=1, ready=1)
    error = watch.overdue()
    assert isinstance(error, ProgressDeadlineExceeded) and error.reason == "ProgressDeadlineExceeded"
    assert str(error).startswith("no training step for 300s (progressDeadlineSeconds=300), no group accepted "
                                 "for 100s: 3 groups dropped because their reward")
    # it is sent from rank 0 to every rank
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    watch.stepped()
    assert watch.overdue() is None
    clock.now += 300
    watch.observe(counts(reward_failures=3), running=1, engines=1, ready=1)  # (the loop observes, then asks)
    assert "1 group(s) still being generated" in str(watch.overdue())
    assert ProgressWatch(stall_after_s=60, deadline_s=None, clock=clock).overdue() is None


def test_the_counts_are_the_workers_and_the_trainers_own():
    snap = AdmissionSnapshot(version=3, accepted=0, running=1, capacity=0, reward_failures=4, engine_requeues=1,
                             last_errors={"reward_failures": "prompt p1: RuntimeError: down"})
    found = pipeline_counts(snap, too_stale=2, stale_error="2 group(s) past the bound")
    assert found.dropped == {"reward_failures": 4, "episode_failures": 0, "generation_failures": 0,
                             "engine_requeues": 1, "too_stale": 2}
    assert found.last_errors == {"reward_failures": "prompt p1: RuntimeError: down",
                                 "too_stale": "2 group(s) past the bound"}


def test_the_clocks_start_when_the_first_engine_registers():
    """Before a rollout engine registers nothing can be generated (start-up has its own deadline):
    no stall, no deadline; both count from the registration."""
    clock = Clock()
    watch = ProgressWatch(stall_after_s=60, deadline_s=300, clock=clock)
    clock.now += 1000
    assert watch.observe(counts(), running=0, engines=0, ready=0) is None
    assert watch.overdue() is None
    assert watch.observe(counts(reward_failures=2), running=1, engines=1, ready=1) is None  # registered: the baseline
    clock.now += 299
    stalled = watch.observe(counts(reward_failures=9), running=1, engines=1, ready=1)
    assert stalled is not None and (stalled.count, stalled.seconds) == (7, 299.0)
    assert watch.overdue() is None
    clock.now += 1
    assert watch.overdue() is not None
