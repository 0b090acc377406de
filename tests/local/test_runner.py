"""`asyncrl run` on one machine: the whole pipeline moves, the trainer's recorded outcome ends the
run (the runner acts as the operator), and a dying child stops the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from asyncrl.infra.net import free_port
from asyncrl.local.redis_server import LocalRedis
from asyncrl.transport.streams import trained_ids
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import ASYNCRL, read_jsonl, redis_query

ETA = 1


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}


@pytest.mark.slow
def test_run_end_to_end_moves_and_leaves_a_run_directory(tmp_path: Path) -> None:
    # (collective weight sync: the trainer broadcasts each version to the engine over gloo; the
    # other runs here keep the default, disk)
    job = JobBuilder.small(name="t-run", batch_size=2, group_size=4, eta=ETA, max_steps=3, checkpoint_interval=2,
                           max_new_tokens=8, trainer={"weightTransport": "collective"}).write(tmp_path / "job.yaml")
    run_dir = tmp_path / "run"
    port = free_port()
    proc = subprocess.Popen(ASYNCRL + ["run", str(job), "--max-steps", "3", "--run-dir", str(run_dir),
                                       "--status-port", str(port), "--no-progress"],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[dict] = []

    def watch() -> None:  # the status endpoint, as a person (or the operator) would poll it
        while proc.poll() is None:
            try:
                seen.append(httpx.get(f"http://127.0.0.1:{port}/status", timeout=2).json())
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate(timeout=500)
    watcher.join(5)
    assert proc.returncode == 0, out[-4000:]
    assert f"http://127.0.0.1:{port}/status" in out
    # The run ended on the trainer's recorded outcome (the trainer itself stays up until told to stop).
    assert "the trainer recorded the outcome: Succeeded (MaxStepsReached) at step 3" in out

    # The status endpoint reported progress while it ran, with staleness within eta.
    assert seen and max(s["step"] for s in seen) >= 2
    assert all((s.get("last_step") or {}).get("staleness_max", 0) <= ETA and s["staleness"]["limit"] == ETA
               for s in seen)

    # Run directory: config, metrics, checkpoints, final weights, one log per process.
    assert (run_dir / "job.yaml").exists()
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]  # versions advance
    assert all(m["staleness_max"] <= ETA for m in metrics)
    assert all(m["tokens"] > 0 for m in metrics)
    assert (run_dir / "weights" / "v3" / "model.safetensors").exists()
    for name in ("engine-0", "rollout-0", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["outcome"] == "succeeded" and summary["final_policy_version"] == 3
    assert summary["reason"] == "MaxStepsReached"
    assert summary["final_weights"] == str((run_dir / "weights" / "v3").resolve())
    from asyncrl.api.outcome import read_outcome_file, read_outcome_redis

    recorded = read_outcome_file(run_dir / "weights", "")
    assert recorded is not None and (recorded.phase, recorded.step, recorded.policy_version) == ("Succeeded", 3, 3)
    state = json.loads((run_dir / "checkpoints" / "step-000003" / "state.json").read_text())
    from asyncrl.trainer.state.checkpoint import lineage_group_ids

    lineage = lineage_group_ids(run_dir / "checkpoints")
    assert state["groups_trained"] == 6
    assert len(lineage) == len(set(lineage)) == 6
    # The engine was moved to every new version by the trainer, over the weight group, never from disk.
    assert [e["weight_version"] for e in state["report"]["rollout"]] == [3]
    assert state["report"]["weight_transport"] == "collective"
    assert state["report"]["weight_sync_disk_fallbacks"] == 0
    assert "weight group asyncrl-" in (run_dir / "logs" / "trainer.log").read_text()

    # Every trained group was acknowledged: reopen the run's Redis (AOF) and look.
    from asyncrl.api.stream_names import StreamNames

    names = StreamNames.for_job("t-run")
    with LocalRedis(run_dir / "redis") as redis:
        async def q(r):
            trained = await trained_ids(r, names)
            consumers = await r.xinfo_consumers(names.trajectories, names.consumer_group)
            pending = {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: c["pending"]
                       for c in consumers}
            return trained, pending

        trained, pending = redis_query(redis.url, q)
        assert redis_query(redis.url, lambda r: read_outcome_redis(r, names)) == recorded
    assert set(lineage) <= trained
    assert pending.get("trainer-0", 0) == 0
    # Nothing of the run is left running.
    procs = json.loads((run_dir / "processes.json").read_text())
    for info in procs.values():
        if info.get("pid"):
            assert not _alive(info["pid"])

    # Running the finished job again in its run directory does nothing (the job already ended).
    again = subprocess.run(ASYNCRL + ["run", str(job), "--max-steps", "3", "--run-dir", str(run_dir),
                                      "--no-progress"], env=_env(), cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "already ended: Succeeded (MaxStepsReached) at step 3" in again.stdout
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by a dead parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_dying_child_stops_the_run_with_its_log_tail(tmp_path: Path) -> None:
    job = JobBuilder.small(name="t-die", batch_size=2, group_size=2, max_steps=100,
                           max_new_tokens=8).write(tmp_path / "job.yaml")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(ASYNCRL + ["run", str(job), "--run-dir", str(run_dir), "--no-progress"],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        procs: dict = {}
        while "rollout-0" not in procs:  # the engine is ready and the worker was started
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.3)
            try:
                procs = json.loads((run_dir / "processes.json").read_text())
            except (OSError, ValueError):
                pass
        os.kill(procs["engine-0"]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "engine-0 stopped unexpectedly (killed by SIGKILL)" in out
    assert "asyncrl engine: serving" in out  # a line of the engine's own log, printed by the runner
    for info in procs.values():
        if info.get("pid"):
            assert not _alive(info["pid"])


def test_a_rerun_in_a_finished_run_directory(tmp_path: Path, redis_url: str) -> None:
    """Succeeded with enough steps: nothing to do. Anything else recorded: forgotten (a new attempt)."""
    from asyncrl.api.outcome import new_outcome, read_outcome_file, read_outcome_redis, write_outcome_file
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.local.runner import _previous_attempt

    names = StreamNames.for_job("t-rerun")
    weights = tmp_path / "weights"

    def record(outcome) -> None:
        redis_query(redis_url, lambda r: r.set(names.outcome, outcome.to_json()))
        write_outcome_file(weights, outcome)

    assert _previous_attempt(redis_url, names, weights, 3) is None
    done = new_outcome("t-rerun", "", "Succeeded", "MaxStepsReached", step=3, policy_version=3)
    record(done)
    assert _previous_attempt(redis_url, names, weights, 3) == done
    assert _previous_attempt(redis_url, names, weights, 5) is None  # more steps asked: a new attempt
    assert read_outcome_file(weights, "") is None
    assert redis_query(redis_url, lambda r: read_outcome_redis(r, names)) is None
    record(new_outcome("t-rerun", "", "Failed", "WeightSyncFailed", step=1))
    assert _previous_attempt(redis_url, names, weights, 3) is None
    assert read_outcome_file(weights, "") is None


def _status(**extra: object) -> dict[str, object]:
    """The trainer's /status document as the runner polls it (JSON), with a few steps done."""
    return {"phase": "Training", "step": 9, "policy_version": 9, "staleness": {"limit": 2, "dropped": 0},
            "last_step": {"reward_mean": 0.25, "tokens_per_second": 80.0, "staleness_mean": 0.5, "staleness_max": 1},
            **extra}


def _eval(version: int, pass_at_1: float) -> dict[str, object]:
    return {"policy_version": version, "reward_mean": pass_at_1, "pass_at_1": pass_at_1, "k": 1, "prompts": 64}


def test_progress_line_shows_the_newest_evaluation(capsys: pytest.CaptureFixture[str]) -> None:
    """`eval <pass@1>@v<version>` of the highest version evaluated, once there is one; a plain line
    is printed again when a new evaluation arrives although step and phase stay the same."""
    from asyncrl.local.runner import Progress

    progress = Progress(max_steps=28, plain=True)
    progress.update(_status())
    progress.update(_status(evaluations=[_eval(0, 0.140625)]))
    progress.update(_status(evaluations=[_eval(0, 0.140625)]))  # nothing new: no line
    progress.update(_status(evaluations=[_eval(0, 0.140625), _eval(7, 0.4167), _eval(14, 0.3)][::-1]))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert "eval" not in lines[0]
    assert lines[1].startswith("[Training] step 9/28  v9  reward 0.250") and lines[1].endswith("  eval 0.14@v0")
    assert lines[2].endswith("  eval 0.30@v14")  # the highest version, not the last listed


def test_progress_line_puts_the_evaluation_before_a_degraded_notice(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrl.local.runner import Progress

    progress = Progress(max_steps=28, plain=True)
    progress.update(_status(evaluations=[_eval(7, 0.5)],
                            degraded={"status": True, "reason": "EngineUnavailable", "message": "engine down"}))
    (line,) = capsys.readouterr().out.splitlines()
    assert "eval 0.50@v7  DEGRADED EngineUnavailable: engine down" in line


def _write_metrics(run_dir: Path, lines: Sequence[dict[str, object] | str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def _step(step: int, reward: float) -> dict[str, object]:
    return {"step": step, "policy_version": step, "reward_mean": reward, "staleness_mean": 0.5, "staleness_max": 1}


def test_read_metrics_skips_evaluation_lines(tmp_path: Path) -> None:
    """metrics.jsonl holds eval lines ({"event": "eval", ...}, which have a reward_mean and a step
    too) beside the per-step lines: steps, rewards and the final version come from step lines only."""
    from asyncrl.local.runner import eval_trend, read_evaluations, read_metrics

    _write_metrics(tmp_path, [
        {"event": "eval", **_eval(0, 0.14), "step": 0}, _step(1, 0.1), _step(2, 0.2),
        {"event": "eval", **_eval(2, 0.5), "step": 3}, _step(3, 0.3), '{"step": 4, "policy_ver',  # cut short
    ])
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]
    assert [e["policy_version"] for e in read_evaluations(tmp_path)] == [0, 2]
    assert eval_trend(read_evaluations(tmp_path)) == {"v0": 0.14, "v2": 0.5}
    assert read_metrics(tmp_path / "absent") == [] and read_evaluations(tmp_path / "absent") == []


def test_run_summary_counts_steps_not_evaluations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """run.json and the last line: steps, the final version and the reward quarters from the step
    lines; the held-out pass@1 of the first and last version evaluated beside them."""
    from asyncrl.api.outcome import new_outcome
    from asyncrl.local.runner import _finish

    _write_metrics(tmp_path, [{"event": "eval", **_eval(0, 0.14), "step": 0}]
                   + [_step(s, 0.1 * s) for s in range(1, 5)]
                   + [{"event": "eval", **_eval(4, 0.375), "step": 4}])
    done = new_outcome("t", "", "Succeeded", "MaxStepsReached", step=4, policy_version=4)
    assert _finish(tmp_path, None, done, "http://127.0.0.1:1", False) == 0
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["steps"] == 4 and summary["final_policy_version"] == 4
    assert (summary["reward_first_quarter"], summary["reward_last_quarter"]) == pytest.approx((0.1, 0.4))
    assert summary["eval_pass_at_1"] == {"v0": 0.14, "v4": 0.375}
    assert "held-out pass@1 0.14@v0 -> 0.38@v4" in capsys.readouterr().out
