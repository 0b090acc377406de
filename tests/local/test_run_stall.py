"""A local run whose verifier is down for good says why it does not train, and ends at its deadline.

`asyncrl run` with a reward service whose function always raises: every group is dropped (never
trained with a made-up reward), so no step is ever made. Within spec.trainer.stallAfterSeconds the
trainer's /status names the cause (RewardFailures) with the count and the last error, the progress
line says STALLED with the same, and with spec.trainer.progressDeadlineSeconds the job ends Failed
(ProgressDeadlineExceeded), the cause in the recorded outcome and the run's terminal line."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.infra.net import free_port
from tests.support.jobs import JobBuilder
from tests.support.reward_services import reward_server
from tests.support.trainer_support import ASYNCRL

STALL_AFTER_S = 5
DEADLINE_S = 40


def stalled_status(url: str, proc: subprocess.Popen, timeout: float) -> dict:
    """The trainer's /status once it reports a stall (fails if the run ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the trainer reported a stall"
        try:
            status = httpx.get(url + "/status", timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            status = {}
        if status.get("stalled"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"no stall reported within {timeout}s")


@pytest.mark.slow
def test_a_verifier_that_always_fails_is_named_with_its_error_and_the_deadline_fails_the_job(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    job = JobBuilder.small(name="t-stall", batch_size=2, group_size=4, eta=1, max_steps=3, max_new_tokens=4,
                           model={"path": str(tiny_model_dir)})
    port = free_port()
    with reward_server("tests.support.reward_services:always_failing", log=tmp_path / "server.log") as url:
        path = job.merge(reward={"function": "exact-number", "service": {"url": url}},
                         trainer={"stallAfterSeconds": STALL_AFTER_S,
                                  "progressDeadlineSeconds": DEADLINE_S}).write(tmp_path / "job.yaml")
        run_dir = tmp_path / "run"
        with (tmp_path / "run.out").open("w") as out:
            proc = subprocess.Popen(ASYNCRL + ["run", str(path), "--run-dir", str(run_dir), "--no-progress",
                                               "--status-port", str(port)],
                                    cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
            try:
                status = stalled_status(f"http://127.0.0.1:{port}", proc, timeout=DEADLINE_S + 60)
                code = proc.wait(timeout=DEADLINE_S + 120)
            finally:
                if proc.poll() is None:
                    proc.kill()
    output = (tmp_path / "run.out").read_text()
    stall = status["stalled"]
    assert (status["phase"], status["step"], stall["reason"]) == ("Waiting", 0, "RewardFailures"), status
    assert stall["count"] >= 1 and stall["seconds"] >= STALL_AFTER_S and stall["dropped"]["reward_failures"] >= 1
    assert "RuntimeError: verifier sandbox unreachable (call" in stall["last_error"], stall
    assert stall["message"].startswith(f"{stall['count']} groups dropped because their reward could not be "
                                       "computed (last error: prompt "), stall
    assert status["recovery"]["reward_failures"] >= stall["count"]
    # the progress line said it, with the count and the error
    assert "STALLED RewardFailures (" in output and "verifier sandbox unreachable" in output, output[-3000:]
    # the deadline ended the job: Failed, with the cause
    assert code == 1, output[-3000:]
    summary = json.loads((run_dir / "run.json").read_text())
    assert (summary["outcome"], summary["reason"], summary["steps"]) == ("failed", "ProgressDeadlineExceeded", 0)
    assert re.match(rf"no training step for 4\ds \(progressDeadlineSeconds={DEADLINE_S}\), no group accepted for "
                    r"\d+s: \d+ groups dropped because their reward could not be computed \(last error: prompt .*"
                    r"verifier sandbox unreachable", summary["message"]), summary
    last = output.strip().splitlines()[-1]
    assert last.startswith("asyncrl run: failed after 0 steps (ProgressDeadlineExceeded)"), last
    assert "; stalled: RewardFailures (" in last, last
