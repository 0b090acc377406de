"""Held-out evaluation: the estimators, one pass (rollout.evaluation.evaluate), and the rollout
worker serving the trainer's requests beside training, against a real Redis and the fake SGLang."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.rollout.data.datasets import ArithmeticSource, PromptItem
from asyncrl.rollout.engines import GenerateResult, SamplingParams
from asyncrl.rollout.engines.base import EngineError
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.evaluation.run_pass import (
    MAX_ABORTS,
    EvalPart,
    EvalSettings,
    EvaluationError,
    eval_items,
    evaluate,
    evaluate_parts,
    merge_records,
    pass_at_k,
    summarize,
)
from asyncrl.rollout.evaluation.service import WorkerEvaluation
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.trainer.weights.engine_update import update_engines
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect
from asyncrl.transport.evaluation import EVALUATORS_GROUP, EvalChannel
from asyncrl.transport.versions import EngineRegistry
from tests.support.polling import poll
from tests.support.reward_services import half_reward
from tests.support.rollout_workers import WorkerEngine, decode, make_worker, published, render
from tests.support.sglang_fake import FakeSGLang, fake_token

EVAL_TOKENS = 3


# ------------------------------------------------------------------ estimators

def test_pass_at_k_matches_enumerating_every_draw():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(itertools.combinations(range(n), k))  # answers 0..c-1 are the correct ones
                hit = sum(any(i < c for i in draw) for draw in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12), (n, c, k)
    for n, c, k in ((3, 1, 0), (3, 1, 4), (3, 4, 1), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_summarize_averages_per_prompt():
    rec = summarize(7, [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], lengths=[4, 6, 2, 8, 3, 1], on_version=0.5,
                    seconds=2.0, engine_id="pod-3")
    assert (rec.policy_version, rec.k, rec.prompts, rec.samples, rec.engine_id) == (7, 2, 3, 6, "pod-3")
    assert rec.reward_mean == pytest.approx(0.5)
    assert rec.pass_at_1 == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert rec.pass_at_k == pytest.approx(2 / 3)
    assert rec.response_length == pytest.approx(4.0) and rec.on_version == 0.5
    single = summarize(0, [[0.5], [1.0]], lengths=[1, 1], on_version=1.0, seconds=0.1)
    assert single.pass_at_k is None and single.pass_at_1 == pytest.approx(0.5)  # 0.5 is not correct
    for bad in ([], [[1.0], []], [[1.0], [1.0, 0.0]]):
        with pytest.raises(ValueError, match="same, non-zero number"):
            summarize(0, bad, lengths=[], on_version=1.0, seconds=0.0)


# ------------------------------------------------------------------ one pass, in process

def chars(question: str) -> list[int]:
    return [ord(c) for c in question]


def chars_of(item: PromptItem) -> list[int]:
    return chars(item.question)


def text(ids: list[int]) -> str:
    return "".join(map(chr, ids))


class ScriptedEngine:
    """A labelled engine in process: answers each known prompt with a scripted text. A prompt in
    `abort_once` is cut short once by a weight update: "abort" with its partial output, and every
    answer after it carries the next label. Strict: unknown prompts and empty budgets are errors."""

    def __init__(self, answers: dict[tuple[int, ...], str], abort_once: Iterable[tuple[int, ...]] = (),
                 label: int = 0, abort_always: bool = False):
        self.answers, self.abort_once, self.label, self.abort_always = answers, set(abort_once), label, abort_always
        self.calls: list[list[int]] = []
        self.labels: list[int] = []
        """The label of every answer that was not aborted."""

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        key = tuple(input_ids)
        if key not in self.answers or params.max_new_tokens < 1:
            raise EngineError(f"bad request {key[:4]}... max_new_tokens={params.max_new_tokens}", url="scripted",
                              status=400, retryable=False)
        self.calls.append(list(input_ids))
        await asyncio.sleep(0)
        out = chars(self.answers[key])[:params.max_new_tokens]
        if key in self.abort_once or self.abort_always:
            self.abort_once.discard(key)
            self.label += 1
            return GenerateResult(out[:1], [-0.5], "abort", self.label - 1)
        self.labels.append(self.label)
        return GenerateResult(out, [-0.5] * len(out), "stop", self.label)


def held_out(n: int) -> list[PromptItem]:
    return eval_items(ArithmeticSource(seed=0, difficulty=1, split="test"), n)


def settings(concurrency: int = 1, samples: int = 1, max_new: int = 16) -> EvalSettings:
    return EvalSettings(samples, SamplingParams(max_new_tokens=max_new, temperature=0.0), concurrency)


async def test_an_aborted_answer_is_generated_again_from_the_start():
    items = held_out(4)
    assert len({i.question for i in items}) == 4 and all(i.prompt_id.startswith("arith-test-") for i in items)
    answers = {tuple(chars(i.question)): (i.answer if n < 2 else "-1") for n, i in enumerate(items)}
    cut = tuple(chars(items[2].question))
    engine = ScriptedEngine(answers, abort_once={cut})
    scorer = RewardScorer(exact_number_reward, 5.0)
    answered = []
    rec = await evaluate(engine, items, render=chars_of, decode=text, scorer=scorer, settings=settings(),
                         version=0, engine_id="local", on_answer=lambda: answered.append(1))
    scorer.close()
    assert engine.calls.count(list(cut)) == 2  # the same prompt again, not prompt + partial output
    assert len(engine.calls) == 5 and len(answered) == 4
    assert (rec.prompts, rec.samples, rec.k, rec.engine_id, rec.policy_version) == (4, 4, 1, "local", 0)
    assert rec.reward_mean == pytest.approx(0.5) and rec.pass_at_1 == pytest.approx(0.5)
    # the update moved the label from 0 to 1: answers generated after it are not version 0's
    assert sorted(engine.labels) == engine.labels and engine.labels[0] == 0 and engine.labels[-1] == 1
    assert rec.on_version == pytest.approx(engine.labels.count(0) / 4) and 0 < rec.on_version < 1
    assert rec.response_length == pytest.approx(sum(len(a) for a in answers.values()) / 4)


async def test_a_pass_that_keeps_being_aborted_fails_and_leaves_no_answer_running():
    items = held_out(3)
    answers = {tuple(chars(i.question)): i.answer for i in items}
    scorer = RewardScorer(exact_number_reward, 5.0)
    engine = ScriptedEngine(answers, abort_always=True)
    with pytest.raises(EvaluationError, match=f"aborted {MAX_ABORTS + 1} times"):
        await evaluate(engine, items[:1], render=chars_of, decode=text, scorer=scorer, settings=settings())

    class OneFails(ScriptedEngine):
        """One prompt is refused at once; the others wait on the engine until cancelled."""

        def __init__(self) -> None:
            super().__init__(answers)
            self.waiting = 0
            self.cancelled = 0

        async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
            if input_ids == chars(items[0].question):
                while self.waiting < 2:  # fail once the other answers are in flight
                    await asyncio.sleep(0)
                raise EngineError("refused", url="scripted", status=400, retryable=False)
            self.waiting += 1
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            raise AssertionError("unreachable")

    failing = OneFails()
    with pytest.raises(EngineError, match="refused"):
        await evaluate(failing, items, render=chars_of, decode=text, scorer=scorer, settings=settings(concurrency=3))
    assert failing.cancelled == 2  # the other answers were stopped, not left generating
    scorer.close()


# ------------------------------------------------------------------ the rollout worker

class GatedEngine(SGLangEngine):
    """The worker's adapter for the fake SGLang, holding eval requests (temperature 0; training
    samples at 1) at a gate the test opens, and counting them."""

    def __init__(self, url: str):
        super().__init__(url)
        self.gate = asyncio.Event()
        self.eval_requests = self.eval_in_flight = self.eval_most = 0

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        if params.temperature != 0.0:
            return await super().generate(input_ids, params)
        self.eval_requests += 1
        self.eval_in_flight += 1
        self.eval_most = max(self.eval_most, self.eval_in_flight)
        try:
            await self.gate.wait()
            return await super().generate(input_ids, params)
        finally:
            self.eval_in_flight -= 1


def evaluation(items: list[PromptItem], *, concurrency: int = 2, max_new: int = EVAL_TOKENS,
               takeover_ms: int = 60_000) -> WorkerEvaluation:
    return WorkerEvaluation(parts=[EvalPart("", items, RewardScorer(exact_number_reward, 5.0))],
                            settings=settings(concurrency, max_new=max_new), block_ms=50, takeover_ms=takeover_ms,
                            touch_s=0.05, retry_s=0.05, retry_max_s=0.2)


def serving(worker: RolloutWorker, ev: WorkerEvaluation) -> RolloutWorker:
    worker.evaluation = ev  # (read when run() starts; rollout/worker/process.py passes it to the constructor)
    return worker


@contextlib.asynccontextmanager
async def running(worker: RolloutWorker) -> AsyncIterator[None]:
    """The worker runs for the block and is stopped at its end, a failed assertion included."""
    task = asyncio.create_task(worker.run())
    try:
        yield
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def test_the_worker_serves_an_evaluation_beside_training(rollout_env, caplog):
    redis, fake, names = rollout_env
    items = held_out(3)
    engine = GatedEngine(fake.url)
    # B=2, eta=0: two groups per trainer version, then the worker waits for admission
    worker = serving(make_worker(redis, fake, names, n=2, batch=2, eta=0, max_concurrent=4, engine=engine),
                     evaluation(items, concurrency=2))
    channel = EvalChannel(redis, names)

    async def groups() -> int:
        return await redis.xlen(names.trajectories)

    caplog.set_level("INFO", logger="asyncrl.rollout.worker")
    async with running(worker):
        await poll(lambda: _at_least(groups, 2), what="the first two groups")
        assert await channel.request(0)
        await poll(lambda: _true(engine.eval_in_flight == 2), what="eval answers in flight")
        assert "evals=0 eval=v0 0/3 " in worker.summary()
        await poll(lambda: _touched(redis, names), what="the worker touching its request")
        snap = await worker.admission.snapshot()
        assert (snap.accepted, snap.running) == (2, 0)  # the evaluation holds no admission lease
        await worker.admission.set_version(1)  # a trainer step: training goes on while the eval waits
        await poll(lambda: _at_least(groups, 4), what="two more groups during the evaluation")
        assert engine.eval_in_flight == 2 and await channel.outstanding() == [0] and await channel.results() == []
        engine.gate.set()
        await poll(channel.results, what="the evaluation's result")
    [(_, rec)] = await channel.results()
    assert (rec.policy_version, rec.prompts, rec.samples, rec.k, rec.engine_id) == (0, 3, 3, 1, "pod-0")
    assert rec.on_version == 1.0 and rec.response_length == EVAL_TOKENS  # the fake's initial weights: version 0
    expected = [exact_number_reward(decode([fake_token(render(i), t) for t in range(EVAL_TOKENS)]), i.answer)
                for i in items]
    assert rec.reward_mean == pytest.approx(sum(expected) / 3)
    assert await channel.outstanding() == []
    assert engine.eval_requests == 3 and engine.eval_most == 2  # its own concurrency, not the training slots
    groups_out = await published(redis, names)  # nothing of the evaluation reached the trajectory stream
    assert len(groups_out) == worker.stats.groups_published == 4
    assert all(g.prompt_id.startswith("arith-0-1-") for g in groups_out)
    assert all(len(s.response_ids) == 6 for g in groups_out for s in g.samples)
    snap = await worker.admission.snapshot()
    assert (snap.accepted, snap.running) == (4, 0)
    assert worker.stats.evaluations == 1 and "evals=1 " in worker.summary()
    assert "evaluated version 0: reward=" in caplog.text and "on_version=1.00 answers=3" in caplog.text


async def _touched(redis, names) -> bool:
    """The request's idle time went down between two reads: its worker touched it (no claim does
    while it evaluates), so no other worker takes it over."""
    idle = []
    for _ in range(2):
        [row] = await redis.xpending_range(names.eval_requests, EVALUATORS_GROUP, min="-", max="+", count=1)
        idle.append(row["time_since_delivered"])
        await asyncio.sleep(0.01)
    return idle[1] < idle[0]


async def _at_least(fn, n: int) -> bool:
    return await fn() >= n


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("labelled", [True, False], ids=["sglang-labels", "unlabelled-like-vllm"])
async def test_an_update_during_an_evaluation_regenerates_its_answers_on_the_new_weights(rollout_env, labelled):
    """The trainer updates the engine while every answer of version 0's evaluation is being
    generated: each is cut short and generated again on version 1, so none is version 0's."""
    redis, fake, names = rollout_env
    fake.state.token_delay = 0.05  # 500 eval tokens: the answers are still running at the update
    items = held_out(3)
    worker = serving(make_worker(redis, fake, names, n=1, engine=WorkerEngine(fake.url, labelled=labelled)),
                     evaluation(items, concurrency=3, max_new=500))
    channel, registry = EvalChannel(redis, names), EngineRegistry(redis, names)

    def eval_calls() -> int:
        return sum(c["max_new_tokens"] == 500 for c in fake.state.generate_calls)

    async def registered():
        return len(await registry.list()) == 1

    async def two():
        return len(await channel.results()) == 2

    async with running(worker):
        await poll(registered, what="the engine registered")
        assert await channel.request(0)
        await poll(lambda: _true(eval_calls() == 3), what="every eval answer sent")
        await update_engines("sglang", await registry.list(), Path("/weights/v1"), 1, registry=registry,
                             timeout_s=10)
        fake.state.token_delay = 0.0
        await poll(channel.results, what="version 0's result")
        assert eval_calls() == 6  # each answer once more, from the start
        assert await channel.request(1)
        await poll(two, what="version 1's result")
    [(_, v0), (_, v1)] = await channel.results()
    assert (v0.policy_version, v0.on_version, v0.samples) == (0, 0.0, 3)
    assert (v1.policy_version, v1.on_version, v1.samples) == (1, 1.0, 3)
    assert v0.response_length == v1.response_length == 500
    assert worker.stats.groups_published >= 1


async def test_a_worker_stopped_mid_evaluation_leaves_it_to_another_worker(rollout_env):
    redis, fake, names = rollout_env
    items = held_out(3)
    channel = EvalChannel(redis, names)
    engine = GatedEngine(fake.url)
    first = serving(make_worker(redis, fake, names, engine=engine), evaluation(items))
    async with running(first):
        assert await channel.request(5)
        await poll(lambda: _true(engine.eval_in_flight == 2), what="the first worker evaluating")
    assert first.stats.evaluations == 0 and engine.eval_in_flight == 0
    assert await channel.outstanding() == [5] and await channel.results() == []
    [row] = await redis.xpending_range(names.eval_requests, EVALUATORS_GROUP, min="-", max="+", count=10)
    assert row["consumer"] == b"pod-0"  # still pending, on the stopped worker

    second = serving(make_worker(redis, fake, names, engine_id="pod-1"), evaluation(items, takeover_ms=200))
    async with running(second):
        await poll(channel.results, what="the second worker's result")
    [(_, rec)] = await channel.results()
    assert (rec.policy_version, rec.engine_id, rec.samples) == (5, "pod-1", 3)
    assert await channel.outstanding() == [] and second.stats.evaluations == 1


async def test_a_stopped_evaluation_stops_touching_its_request_even_when_a_cancellation_is_lost(
        rollout_env, monkeypatch):
    """Found chasing the flake of the takeover test above: redis-py on Python 3.11 can lose a
    cancellation that lands as a command completes (CPython gh-86296). A touch loop that lost its
    cancellation kept touching a stopped worker's request, so no other worker could take it over."""
    redis, fake, names = rollout_env
    touches: list[str] = []
    lost: list[int] = []
    in_touch: list[int] = []
    original = EvalChannel.touch

    async def touch(self, consumer, request):
        touches.append(consumer)
        in_touch.append(1)
        try:
            await asyncio.sleep(0.2)  # a slow round trip: the stop lands in it
        except asyncio.CancelledError:
            if lost:
                raise
            lost.append(1)  # swallowed, and the command completes, as redis-py sometimes does
        finally:
            in_touch.pop()
        await original(self, consumer, request)

    monkeypatch.setattr(EvalChannel, "touch", touch)
    channel = EvalChannel(redis, names)
    worker = serving(make_worker(redis, fake, names, engine=GatedEngine(fake.url)), evaluation(held_out(3)))
    async with running(worker):
        assert await channel.request(5)
        await poll(lambda: _true(len(touches) >= 2 and in_touch), what="the evaluation touching its request")
    assert lost == [1]
    stopped_at = len(touches)
    await asyncio.sleep(0.5)  # a live touch loop would have touched twice by now
    assert len(touches) == stopped_at


class LosesOneCancellation(Admission):
    """Admission whose wait for a lease loses the first cancellation, as redis-py's commands do on
    Python 3.11 when it lands just as one completes (asyncio.wait_for, CPython gh-86296)."""

    lost = 0

    async def acquire(self, holder: str, poll_s: float = 0.05, timeout: float | None = None) -> str:
        while True:
            try:
                return await super().acquire(holder, poll_s, timeout)
            except asyncio.CancelledError:
                if self.lost:
                    raise
                self.lost += 1


async def test_a_stopping_worker_is_not_held_by_a_lost_cancellation(rollout_env):
    """Found with the rollout command's evaluation test: SIGTERM sometimes left the worker polling
    for a lease for good. The wait is cancelled again until it ends."""
    redis, fake, names = rollout_env
    worker = make_worker(redis, fake, names, n=2, batch=1, eta=0)
    worker.admission = admission = LosesOneCancellation(redis, names, batch_size=1,
                                                        staleness=StalenessPolicy.global_budget(0),
                                                        max_concurrent=8, lease_seconds=30)
    run = asyncio.create_task(worker.run())

    async def blocked():  # one group accepted, the worker waits for the next lease
        return await redis.xlen(names.trajectories) == 1 and (await admission.snapshot()).running == 0

    await poll(blocked, what="the worker waiting for a lease")
    worker.stop()
    stats = await asyncio.wait_for(run, 30)
    assert admission.lost == 1 and stats.groups_published == 1


def test_evaluation_settings_must_keep_a_running_evaluation_fresh():
    items = held_out(1)
    scorer = RewardScorer(exact_number_reward, 5.0)
    with pytest.raises(ValueError, match="touch_s"):
        WorkerEvaluation(parts=[EvalPart("", items, scorer)], settings=settings(), touch_s=60, takeover_ms=60_000)
    with pytest.raises(ValueError, match="a part has no items"):
        WorkerEvaluation(parts=[EvalPart("", [], scorer)], settings=settings())
    with pytest.raises(ValueError, match="a part has no items"):
        WorkerEvaluation(parts=[], settings=settings())
    scorer.close()


JOB_YAML = """
apiVersion: asyncrl.dev/v1alpha1
kind: AsyncRLJob
metadata:
  name: eval-rollout
spec:
  model:
    path: embedded:SmolLM2-135M-Instruct
  evaluation:
    dataset:
      source: {source}
"""


def test_the_rollout_command_refuses_a_bad_eval_dataset(tmp_path: Path):
    missing = tmp_path / "missing" / "test.jsonl"
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.format(source=missing))
    env_vars = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "rollout", "--config", str(job)], cwd=str(tmp_path),
                          env=env_vars, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ERROR asyncrl.rollout: spec.evaluation.dataset" in proc.stderr
    assert f"dataset file {missing} does not exist" in proc.stderr


@pytest.mark.slow
async def test_the_rollout_command_serves_evaluations_from_the_job_file(redis_url, tmp_path: Path):
    """rollout/main.py wires spec.evaluation: held-out prompts, answer length, the worker's evaluator."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.format(source="builtin:arithmetic") + "      split: test\n    prompts: 4\n"
                   "    maxNewTokens: 5\n  algorithm:\n    groupSize: 2\n    batchSize: 2\n    maxNewTokens: 4\n")
    fake = FakeSGLang(token_delay=0.01)
    fake.start()
    redis = await connect(redis_url)
    channel = EvalChannel(redis, StreamNames.for_job("eval-rollout"))
    env_vars = dict(os.environ, ASYNCRL_REDIS_URL=redis_url, ASYNCRL_ENGINE_URL=fake.url, ASYNCRL_POD_NAME="rollout-0")
    log = tmp_path / "rollout.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout", "--config", str(job), "--log-every",
                                 "0.2"], cwd=str(tmp_path), env=env_vars, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert await channel.request(0)

        async def result():
            assert proc.poll() is None, log.read_text()
            return await channel.results()

        [(_, rec)] = await poll(result, timeout=120, what="the evaluation's result")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        fake.stop()
        await redis.aclose()
    assert (rec.policy_version, rec.prompts, rec.samples, rec.engine_id) == (0, 4, 4, "rollout-0")
    assert rec.response_length <= 5  # evaluation.maxNewTokens, not algorithm.maxNewTokens
    evals = [c for c in fake.state.generate_calls if c["max_new_tokens"] == 5]
    assert len(evals) == 4
    text = log.read_text()
    assert "evaluation of 4 held-out prompts" in text and "evaluated version 0: reward=" in text


# ------------------------------------------------------------------------- several sources of held-out prompts


async def test_a_pass_over_several_sources_reports_each_and_all_of_them():
    """spec.evaluation.datasets: each source answered and scored its own way, the record's figures
    over every prompt, and each source's pass@1 and reward beside them."""
    easy, hard = held_out(3), eval_items(ArithmeticSource(seed=0, difficulty=3, split="test"), 1)
    answers = {tuple(chars(i.question)): i.answer for i in easy} | {tuple(chars(hard[0].question)): "-1"}
    engine = ScriptedEngine(answers)
    exact, half = RewardScorer(exact_number_reward, 5.0), RewardScorer(half_reward, 5.0)
    rec = await evaluate_parts(engine, [EvalPart("easy", easy, exact), EvalPart("hard", hard, half)],
                               render=chars_of, decode=text, settings=settings(), version=3, engine_id="e")
    exact.close()
    half.close()
    assert rec.pass_at_1_by_source == {"easy": 1.0, "hard": 0.0}
    assert rec.reward_by_source == {"easy": 1.0, "hard": 0.5}  # ("hard" scored by its own reward)
    assert (rec.prompts, rec.samples, rec.policy_version, rec.engine_id) == (4, 4, 3, "e")
    assert rec.pass_at_1 == pytest.approx(3 / 4) and rec.reward_mean == pytest.approx(3.5 / 4)


def test_merging_weighs_each_source_by_its_prompts_and_answers():
    a = summarize(2, [[1.0, 0.0], [1.0, 1.0]], lengths=[4, 4, 4, 4], on_version=1.0, seconds=2.0)
    b = summarize(2, [[0.0, 0.0]], lengths=[10, 10], on_version=0.5, seconds=1.0)
    merged = merge_records({"a": a, "b": b})
    assert (merged.prompts, merged.samples, merged.k, merged.seconds) == (3, 6, 2, 3.0)
    assert merged.pass_at_1 == pytest.approx((0.75 * 2 + 0.0) / 3)
    assert merged.pass_at_k == pytest.approx((1.0 * 2 + 0.0) / 3)
    assert merged.reward_mean == pytest.approx(3 / 6) and merged.on_version == pytest.approx(5 / 6)
    assert merged.response_length == pytest.approx(36 / 6)
    assert merged.pass_at_1_by_source == {"a": 0.75, "b": 0.0} and merged.reward_by_source == {"a": 0.75, "b": 0.0}
    assert merge_records({"": a}) == a  # (one dataset: its record as it was, no per-source figures)
