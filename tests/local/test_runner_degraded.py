"""`asyncrl run`'s progress line says Degraded while the trainer's /status does (issue 15, item 5)."""

from __future__ import annotations

import pytest

from asyncrl.local.runner import Progress


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
