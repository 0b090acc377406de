"""`asyncrl run`'s progress line says Degraded, or Stalled and why, while the trainer's /status does;
its terminal line quotes the last stall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.local.runner import Progress, _finish


def status(**extra: object) -> dict[str, object]:
    return {"phase": "Waiting", "step": 3, "policy_version": 3, "staleness": {"limit": 2, "dropped": 0},
            "last_step": {"reward_mean": 0.5, "tokens_per_second": 10.0, "staleness_mean": 0.5, "staleness_max": 1},
            **extra}


def test_plain_progress_line_says_degraded_and_when_it_ends(capsys: pytest.CaptureFixture[str]) -> None:
    """A plain line is printed when the outage begins and when it ends, although step and phase
    stay the same (the trainer is waiting in both)."""
    outage = {"status": True, "reason": "RedisUnavailable",
              "message": "Redis r:6379/0 unreachable for 12s (ConnectionError: refused); retrying for up to 180s"}
    progress = Progress(max_steps=10, plain=True)
    progress.update(status())
    progress.update(status(degraded=outage))
    progress.update(status(degraded={**outage, "message": "Redis r:6379/0 unreachable for 14s (...)"}))  # same outage
    progress.update(status())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert "DEGRADED" not in lines[0] and "DEGRADED" not in lines[2]
    assert "[Waiting] step 3/10" in lines[1]
    assert "DEGRADED RedisUnavailable: Redis r:6379/0 unreachable for 12s" in lines[1]


def test_plain_progress_line_says_stalled_with_the_cause_and_the_terminal_line_quotes_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A plain line when the stall begins and when its cause changes (not for each new count); the
    run's terminal line and run.json keep the stall of the last status read."""
    def stall(reason: str, count: int) -> dict[str, object]:
        return {"reason": reason, "seconds": 60 + count, "count": count,
                "message": f"{count} groups dropped because their reward could not be computed (last error: "
                           "prompt p1: RuntimeError: verifier down)"}
    progress = Progress(max_steps=10, plain=True)
    progress.update(status())
    progress.update(status(stalled=stall("RewardFailures", 12)))
    progress.update(status(stalled=stall("RewardFailures", 15)))
    progress.update(status(stalled=stall("TooStale", 16)))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert ("STALLED RewardFailures (72s): 12 groups dropped because their reward could not be computed (last error: "
            "prompt p1: RuntimeError: verifier down)") in lines[1]
    assert "STALLED TooStale (76s)" in lines[2]
    assert _finish(tmp_path, None, None, "http://127.0.0.1:1", True, progress.stalled) == 130
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("asyncrl run: interrupted after 0 steps") and "; stalled: TooStale (76s): 16 groups" in last
    assert json.loads((tmp_path / "run.json").read_text())["stalled"].startswith("TooStale (76s): 16 groups")
    progress.update(status())
    assert progress.stalled == ""
