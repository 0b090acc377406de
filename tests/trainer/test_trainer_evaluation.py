"""The trainer's side of held-out evaluation (spec.evaluation), against a real Redis: it asks for
versions 0, every N-th and the final one, each once and only after publishing it; results a
(simulated) rollout worker hands back through the real EvalChannel reach /status, metrics.jsonl,
/metrics and the trackers; the end waits for the final version's result (or its timeout, or a
stop); a restarted trainer rebuilds the list without duplicating anything.

The trainer runs on a tiny copy of SmolLM2's architecture (tests/trainer/state/test_commit_window.py) so a step
takes milliseconds; the evaluation worker is simulated with the channel's worker side
(`claim`/`complete`), which is what rollout workers use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.status_report import EvalRecord
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import (
    chat_groups,
    model_and_tokenizer,
    publish,
    read_jsonl,
    redis_query,
    tiny_model,
)

JOB = "t-eval"
BATCH = 2
WORKER = "evaluator-0"
FINAL_TIMEOUT_WARNING = "finishing without it"
STOP_WARNING = "stop requested: not waiting any longer"


def _job(*, max_steps: int = 5, every: int = 3, final_timeout: int = 300, interval: int = 2,
         evaluation: bool = True) -> AsyncRLJob:
    doc = JobBuilder.small(name=JOB, batch_size=BATCH, max_steps=max_steps, checkpoint_interval=interval, eta=100).doc()
    if evaluation:
        doc["spec"]["evaluation"] = {"everySteps": every, "prompts": 4, "samplesPerPrompt": 2, "temperature": 1.0,
                                     "finalTimeoutSeconds": final_timeout}
    return AsyncRLJob.model_validate(doc)






class RecordingTrackers:
    """A tracker as strict as the real ones: typed arguments, nothing after close, closed once."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.evals: list[tuple[int, EvalRecord]] = []
        self.closed = 0

    def log_step(self, step: int, figures: dict[str, float]) -> None:
        assert not self.closed and isinstance(step, int)
        assert figures and all(isinstance(k, str) and type(v) is float for k, v in figures.items()), figures
        self.steps.append((step, figures))

    def log_eval(self, step: int, record: EvalRecord) -> None:
        assert not self.closed and isinstance(step, int) and isinstance(record, EvalRecord)
        self.evals.append((step, record))

    def close(self) -> None:
        assert not self.closed, "closed twice"
        self.closed += 1


class Life:
    """One life of the trainer (what trainer/main.py build_trainer + connect_io do, on the tiny
    model): resumed from the newest checkpoint with its report, metrics.jsonl cut back to it; every
    call that publishes a version, sets admission's version or asks for an evaluation is logged."""

    def __init__(self, tmp: Path, job: AsyncRLJob, io: Any, trackers: RecordingTrackers | None = None) -> None:
        from asyncrl.api.status_report import TrainerReport
        from asyncrl.trainer.distributed import DistContext
        from asyncrl.trainer.loop import Trainer
        from asyncrl.trainer.report.metrics_file import truncate_metrics
        from asyncrl.trainer.run_config import RunConfig
        from asyncrl.trainer.state.checkpoint import latest_checkpoint, load_checkpoint

        _, tok = model_and_tokenizer()
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = RunConfig(engine_kind="hf", weights_dir=tmp / "weights", checkpoint_dir=tmp / "ckpt",
                        metrics_path=tmp / "metrics.jsonl", read_block_ms=50)
        ckpt = latest_checkpoint(cfg.checkpoint_dir)
        state = load_checkpoint(ckpt, model, opt) if ckpt is not None else None
        report = TrainerReport.model_validate(state.report) if state is not None and state.report else None
        truncate_metrics(cfg.metrics_path, state.step if state is not None else 0)
        self.calls: list[tuple[str, int, bool]] = []
        self._log(io.versions, "publish", lambda event: event.version)
        self._log(io.admission, "set_version", lambda version: version)
        if io.evals is not None:
            self._log(io.evals, "request", lambda version: version)
        self.trainer = Trainer(job, cfg, DistContext(), model, opt, tok, io=io, state=state, report=report,
                               trackers=trackers)

    def _log(self, obj: Any, name: str, version_of: Callable[[Any], int]) -> None:
        real = getattr(obj, name)

        async def logged(arg: Any) -> Any:
            result = await real(arg)
            self.calls.append((name, version_of(arg), bool(result) if name == "request" else True))
            return result

        setattr(obj, name, logged)

    def asked(self) -> list[int]:
        """Versions whose evaluation request was new (the channel said it was not asked before)."""
        return [v for name, v, new in self.calls if name == "request" and new]


def _record(version: int) -> EvalRecord:
    """What an evaluator reports for `version` (distinct figures per version)."""
    return EvalRecord(policy_version=version, reward_mean=0.1 + 0.01 * version, pass_at_1=0.05 * version,
                      pass_at_k=min(1.0, 0.1 * version), k=2, prompts=4, samples=8, seconds=0.01,
                      engine_id="engine-test", time=time.time())


async def _evaluator(redis_url: str, done: asyncio.Event, *, hold_final: int | None = None, trainer: Any = None,
                     answer: bool = True, on_hold: Callable[[Any, asyncio.Event], Awaitable[None]] | None = None,
                     ) -> None:
    """A rollout worker's evaluation side, until `done`: claim each request, answer it.
    `hold_final`: answer that version only once the trainer shows phase Evaluating (after
    `await on_hold(trainer, done)`, if given); `answer` False: claim and never answer.

    (It stops on `done`, between commands: cancelling a task inside a redis-py command can leave it
    hanging on its connection.)"""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.connection import connect
    from asyncrl.transport.evaluation import EvalChannel

    redis = await connect(redis_url)
    channel = EvalChannel(redis, StreamNames.for_job(JOB))
    await channel.ensure_group()
    try:
        while not done.is_set():
            request = await channel.claim(WORKER, block_ms=50, min_idle_ms=600_000)
            if request is None or not answer:
                await asyncio.sleep(0.02)
                continue
            if request.version == hold_final:
                while trainer.get_report().phase != "Evaluating" and not done.is_set():
                    await asyncio.sleep(0.02)
                if on_hold is not None:
                    await on_hold(trainer, done)
                if done.is_set():
                    break
            await channel.complete(request, _record(request.version))
    finally:
        await redis.aclose()


async def _life(tmp: Path, job: AsyncRLJob, redis_url: str, *, trackers: RecordingTrackers | None = None,
                stop_after: int | None = None, **evaluator: Any) -> tuple[Life, str]:
    """Run one life of the trainer beside an evaluator; `stop_after`: ask it to stop after that step."""
    from asyncrl.api.runtime import Runtime
    from asyncrl.trainer.main import connect_io

    runtime = Runtime(redis_url=redis_url, weights_dir=tmp / "weights", checkpoint_dir=tmp / "ckpt",
                      run_dir=tmp, pod_name="trainer-0")
    io = await connect_io(job, runtime)
    try:
        life = Life(tmp, job, io, trackers)
        trainer = life.trainer
        if stop_after is not None:
            finish = trainer.finish_step

            def finish_then_stop(groups: list[Any], record: dict[str, Any]) -> None:
                finish(groups, record)
                trainer.stop_requested = trainer.state.step >= stop_after

            trainer.finish_step = finish_then_stop
        done = asyncio.Event()
        worker = asyncio.create_task(_evaluator(redis_url, done, trainer=trainer, **evaluator)) \
            if job.spec.evaluation is not None else None
        if worker is not None:  # a failing evaluator (an assertion of the test) ends the trainer's waits too
            worker.add_done_callback(lambda t: setattr(trainer, "stop_requested", bool(t.exception())))
        try:
            phase = await trainer.run()
        finally:
            done.set()
            if worker is not None:
                await worker
        return life, phase
    finally:
        await io.redis.aclose()


def _results(redis_url: str) -> list[EvalRecord]:
    """Every result in the job's results stream, oldest first."""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.evaluation import EvalChannel

    async def read(r: Any) -> list[EvalRecord]:
        return [rec for _, rec in await EvalChannel(r, StreamNames.for_job(JOB)).results()]

    return redis_query(redis_url, read)


def _lines(tmp: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """metrics.jsonl's (per-step lines, eval lines)."""
    lines = read_jsonl(tmp / "metrics.jsonl")
    return [x for x in lines if "event" not in x], [x for x in lines if x.get("event") == "eval"]


def _key(x: EvalRecord | dict[str, Any]) -> tuple[int, float]:
    return (x.policy_version, x.time) if isinstance(x, EvalRecord) else (x["policy_version"], x["time"])


async def _scrape(trainer: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics of the trainer's status app (served in-process), as {(name, labels): value}."""
    from asyncrl.trainer.report.status_api import create_app

    app = create_app(trainer.get_report, health=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
        resp = await client.get("/metrics")
    assert resp.status_code == 200, resp.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_versions_are_evaluated_after_their_publish_and_results_reach_every_output(
        tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    job = _job(max_steps=5, every=3)
    publish(redis_url, JOB, chat_groups(JOB, BATCH * 5))
    trackers = RecordingTrackers()
    seen_while_evaluating: dict[str, Any] = {}

    async def look(trainer: Any, done: asyncio.Event) -> None:  # the trainer waits for the final result
        seen_while_evaluating["report"] = trainer.get_report()
        seen_while_evaluating["metrics"] = await _scrape(trainer)

    with caplog.at_level(logging.INFO, logger="asyncrl.trainer"):
        life, phase = asyncio.run(_life(tmp_path, job, redis_url, trackers=trackers, hold_final=5, on_hold=look))
    trainer = life.trainer
    assert phase == "Succeeded" and trainer.state.step == 5
    report = trainer.get_report()
    assert report.phase == "Succeeded" and report.reason == "MaxStepsReached"

    # Asked for v0 (the start), v3 (every 3rd) and v5 (the final one): each once, each only after
    # its weights were published and admission moved to it (v0: the base model the engines serve).
    assert life.asked() == [0, 3, 5]
    for version in life.asked():
        asked_at = life.calls.index(("request", version, True))
        assert ("set_version", version, True) in life.calls[:asked_at]
        if version > 0:
            assert ("publish", version, True) in life.calls[:asked_at]
    assert [r.policy_version for r in _results(redis_url)] == [0, 3, 5]  # one evaluation each

    # The wait for the final version: phase Evaluating, it ended when the result came (no warning).
    waiting = seen_while_evaluating["report"]
    assert waiting.phase == "Evaluating" and "policy version 5" in waiting.message
    assert [r.policy_version for r in waiting.evaluations] == [0, 3]
    assert seen_while_evaluating["metrics"][("asyncrl_trainer_phase", (("asyncrl_trainer_phase", "Evaluating"),))] == 1
    assert FINAL_TIMEOUT_WARNING not in caplog.text and STOP_WARNING not in caplog.text

    # /status: every result, oldest first, as the worker reported it.
    results = _results(redis_url)
    assert report.evaluations == results
    status = report.model_dump(mode="json")
    assert [e["pass_at_k"] for e in status["evaluations"]] == [0.0, pytest.approx(0.3), pytest.approx(0.5)]

    # metrics.jsonl: the per-step lines as before, plus one eval line per result with the step it was read at.
    steps, evals = _lines(tmp_path)
    assert [x["step"] for x in steps] == [1, 2, 3, 4, 5]
    assert [_key(x) for x in evals] == [_key(r) for r in results]
    for line, record in zip(evals, results, strict=True):
        assert EvalRecord.model_validate(line) == record
        assert 0 <= line["step"] <= 5 and line["step"] >= line["policy_version"]
    assert evals[-1]["step"] == 5  # (read during the final wait)

    # /metrics: the newest evaluation.
    m = asyncio.run(_scrape(trainer))
    assert m[("asyncrl_eval_policy_version", ())] == 5
    assert m[("asyncrl_eval_reward", ())] == pytest.approx(0.15)
    assert m[("asyncrl_eval_pass_at_1", ())] == pytest.approx(0.25)
    assert m[("asyncrl_eval_pass_at_k", (("k", "2"),))] == pytest.approx(0.5)

    # Trackers: each step's figures (the numbers of its metrics.jsonl line), each result once, closed.
    assert [s for s, _ in trackers.steps] == [1, 2, 3, 4, 5]
    for (_, figures), line in zip(trackers.steps, steps, strict=True):
        assert figures["reward_mean"] == line["reward_mean"] and figures["tokens"] == line["tokens"]
        assert "staleness_histogram" not in figures and "step" not in figures
    assert [(s, _key(r)) for s, r in trackers.evals] == [(x["step"], _key(x)) for x in evals]
    assert trackers.closed == 1


@pytest.mark.slow
def test_a_restarted_trainer_rebuilds_the_evaluations_without_duplicates(tmp_path: Path, redis_url: str) -> None:
    job = _job(max_steps=5, every=3, interval=2)
    publish(redis_url, JOB, chat_groups(JOB, BATCH * 5))
    trackers = [RecordingTrackers() for _ in range(3)]

    # Life 1 stops after step 4 (checkpoint 4); life 2 resumes there and finishes; life 3 is a
    # restart after the end (before the outcome was recorded): the final result was read after
    # the last checkpoint, so only metrics.jsonl knows it was handled.
    first, phase = asyncio.run(_life(tmp_path, job, redis_url, trackers=trackers[0], stop_after=4))
    assert phase == "Stopped" and first.trainer.state.step == 4
    second, phase = asyncio.run(_life(tmp_path, job, redis_url, trackers=trackers[1]))
    assert phase == "Succeeded" and second.trainer.state.step == 5
    third, phase = asyncio.run(_life(tmp_path, job, redis_url, trackers=trackers[2]))
    assert phase == "Succeeded" and third.trainer.state.step == 5

    # Asked: v0, v3 in life 1; the restored v4 and the final v5 in life 2; nothing new in life 3.
    assert (first.asked(), second.asked(), third.asked()) == ([0, 3], [4, 5], [])
    results = _results(redis_url)
    assert [r.policy_version for r in results] == [0, 3, 4, 5]
    for life in (second, third):
        assert life.trainer.get_report().evaluations == results  # once each, oldest first
    _, evals = _lines(tmp_path)
    assert sorted(_key(x) for x in evals) == sorted(_key(r) for r in results)  # one line per result
    logged = [_key(r) for t in trackers for _, r in t.evals]
    assert sorted(logged) == sorted(_key(r) for r in results)  # each handed to the trackers once
    assert trackers[2].evals == [] and all(t.closed == 1 for t in trackers)


@pytest.mark.slow
def test_no_final_result_ends_the_wait_after_the_timeout_with_a_warning(
        tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    job = _job(max_steps=2, every=10, final_timeout=1)
    publish(redis_url, JOB, chat_groups(JOB, BATCH * 2))

    with caplog.at_level(logging.INFO, logger="asyncrl.trainer"):
        life, phase = asyncio.run(_life(tmp_path, job, redis_url, answer=False))  # claimed, never answered
    assert phase == "Succeeded"
    report = life.trainer.get_report()
    assert (report.phase, report.reason, report.evaluations) == ("Succeeded", "MaxStepsReached", [])
    assert life.asked() == [0, 2]
    assert FINAL_TIMEOUT_WARNING in caplog.text and "final policy version 2" in caplog.text
    m = asyncio.run(_scrape(life.trainer))
    assert math.isnan(m[("asyncrl_eval_policy_version", ())]) and math.isnan(m[("asyncrl_eval_reward", ())])
    assert not [k for k in m if k[0] == "asyncrl_eval_pass_at_k"]


@pytest.mark.slow
def test_a_stop_request_ends_the_final_wait(tmp_path: Path, redis_url: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    job = _job(max_steps=2, every=10, final_timeout=600)
    publish(redis_url, JOB, chat_groups(JOB, BATCH * 2))

    async def stop(trainer: Any, done: asyncio.Event) -> None:  # SIGTERM while the trainer waits
        trainer.stop_requested = True  # (what StopSignals does)
        await done.wait()  # and the result never comes

    with caplog.at_level(logging.INFO, logger="asyncrl.trainer"):
        life, phase = asyncio.run(_life(tmp_path, job, redis_url, hold_final=2, on_hold=stop))
    assert phase == "Succeeded"  # trained to the end: the missing evaluation does not fail the job
    assert STOP_WARNING in caplog.text and FINAL_TIMEOUT_WARNING not in caplog.text
    assert [r.policy_version for r in life.trainer.get_report().evaluations] == [0]


@pytest.mark.slow
def test_without_evaluation_nothing_is_asked_or_read(tmp_path: Path, redis_url: str) -> None:
    from asyncrl.api.stream_names import StreamNames

    job = _job(max_steps=2, evaluation=False)
    publish(redis_url, JOB, chat_groups(JOB, BATCH * 2))
    trackers = RecordingTrackers()
    life, phase = asyncio.run(_life(tmp_path, job, redis_url, trackers=trackers))
    assert phase == "Succeeded" and life.trainer.evaluations.inbox is None
    names = StreamNames.for_job(JOB)
    assert redis_query(redis_url, lambda r: r.exists(names.eval_requests, names.eval_results)) == 0
    steps, evals = _lines(tmp_path)
    assert [x["step"] for x in steps] == [1, 2] and evals == []
    assert life.trainer.get_report().evaluations == []
    assert [s for s, _ in trackers.steps] == [1, 2] and trackers.evals == [] and trackers.closed == 1


def test_eval_lines_sit_beside_step_lines_and_are_cut_back_on_resume(tmp_path: Path) -> None:
    from asyncrl.trainer.report.metrics_file import append_eval_line, truncate_metrics, written_evaluations

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2, 3)))
    early, late = _record(0), _record(3)
    append_eval_line(path, 1, early)
    append_eval_line(path, 3, late)
    assert written_evaluations(path) == [early, late]
    truncate_metrics(path, 2)  # a resume from step 2: what was read after it is read again
    assert written_evaluations(path) == [early]
    steps, evals = _lines(tmp_path)
    assert [x["step"] for x in steps] == [1, 2]
    assert evals == [{"event": "eval", **early.model_dump(mode="json"), "step": 1}]
