"""Rewards as a service: the real `asyncrl reward-server` process, the worker's HTTP client, and a
rollout worker (fake SGLang, real Redis) scoring through it exactly as it scores in-process."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.api.spec import RewardSpec
from asyncrl.infra.net import free_port
from asyncrl.rollout.rewards.client import HttpRewardScorer
from asyncrl.rollout.rewards.functions import RewardFailed, RewardScorer
from asyncrl.rollout.rewards.scorers import scorer_for
from asyncrl.rollout.worker.prompt_cursor import cursor_key
from tests.support.jobs import JobBuilder
from tests.support.reward_services import RECORD_ENV, digit_sum_reward, length_reward, reward_server
from tests.support.rollout_workers import make_worker, published
from tests.support.trainer_support import ASYNCRL, read_jsonl

PLUGINS = "tests.support.reward_services"
COMPLETIONS = ["3 14 15 92", "65 35", "8", "97 93 23 84 62 64"]


async def test_the_service_scores_what_the_function_scores_in_process_behind_its_key(tmp_path: Path) -> None:
    with reward_server(f"{PLUGINS}:digit_sum_reward", api_key="s3cret", log=tmp_path / "server.log") as url:
        service = HttpRewardScorer(url, api_key="s3cret", retries=2)
        in_process = RewardScorer(digit_sum_reward, 5.0)
        assert await service.ready() and await in_process.ready()  # (the worker waits for this at start)
        got = await service.score_all(COMPLETIONS, "12", "What is 5 + 7?")
        assert got == await in_process.score_all(COMPLETIONS, "12") == [digit_sum_reward(c, "12") for c in COMPLETIONS]
        assert len(set(got)) > 1 and await service.score("8", "12") == got[2]
        async with httpx.AsyncClient() as http:
            assert (await http.get(url + "/health")).status_code == 200  # (probes carry no key)
            refused = await http.post(url + "/score", json={"items": [{"completion": "1", "answer": "1"}]})
            assert refused.status_code == 401
            empty = await http.post(url + "/score", json={"items": []}, headers={"Authorization": "Bearer s3cret"})
            assert empty.status_code == 422
        keyless = HttpRewardScorer(url, api_key=None, retries=2)
        [failed] = await keyless.score_all(["1"], "1")
        assert isinstance(failed, RewardFailed) and "HTTP 401" in str(failed)
        assert keyless.errors == 1  # a refusal is not tried again: the same request would fail again
        in_process.close()


async def test_items_the_service_cannot_score_fail_alone_and_are_never_a_zero_unless_asked(tmp_path: Path) -> None:
    with reward_server(f"{PLUGINS}:down_for_even_answers", log=tmp_path / "server.log") as url:
        drop = HttpRewardScorer(url, on_error="drop")
        assert await drop.score_all(COMPLETIONS[:2], "3") == [digit_sum_reward(c, "3") for c in COMPLETIONS[:2]]
        failed = await drop.score_all(COMPLETIONS[:2], "4")
        assert all(isinstance(f, RewardFailed) and "RuntimeError: verifier down" in str(f) for f in failed)
        with pytest.raises(RewardFailed, match=r"failed \(2 tries\): .*verifier down"):
            await drop.score("1", "4")
        # the requests worked: the items failed, each sent again once (reward.retries, default 1) and failed again
        assert (drop.errors, drop.retried, drop.failed) == (6, 3, 3)
        zero = HttpRewardScorer(url, on_error="zero")
        assert await zero.score_all(COMPLETIONS[:2], "4") == [0.0, 0.0] and zero.failed == 2


async def test_items_a_flaky_verifier_fails_are_sent_again_and_counted(tmp_path: Path) -> None:
    """The worker owns reward.retries for a service: an item answered with `error` is sent again (alone:
    the others keep their scores); `asyncrl reward-server --retries` retries inside the service instead."""
    with reward_server(f"{PLUGINS}:flaky_every_fourth", log=tmp_path / "server.log") as url:
        scorer = HttpRewardScorer(url)  # (retries 1, the spec's default)
        for _ in range(3):  # 4 items a request: the fourth call of each fails, and is sent again
            got = await scorer.score_all(COMPLETIONS, "1")
            assert got == [length_reward(c, "1") for c in COMPLETIONS]
        assert (scorer.errors, scorer.retried, scorer.failed) == (3, 3, 0)
        once = HttpRewardScorer(url, retries=0)
        results = await once.score_all(COMPLETIONS[:1] * 4, "1")  # (the server's 16th call fails, one of these)
        [failed] = [r for r in results if isinstance(r, RewardFailed)]
        assert re.search(r"failed \(1 try\): reward .*flaky_every_fourth.* failed \(1 try\): RuntimeError: "
                         r"flaky verifier \(call 16\)", str(failed)), str(failed)
        async with httpx.AsyncClient() as http:
            health = (await http.get(url + "/health")).json()
        assert (health["scored"], health["errors"], health["retried"], health["failed"]) == (19, 4, 0, 4)
    with reward_server(f"{PLUGINS}:flaky_every_fourth", log=tmp_path / "inside.log", retries=1) as url:
        scorer = HttpRewardScorer(url, retries=0)
        assert await scorer.score_all(COMPLETIONS, "1") == [length_reward(c, "1") for c in COMPLETIONS]
        assert (scorer.errors, scorer.retried) == (0, 0)
        async with httpx.AsyncClient() as http:
            health = (await http.get(url + "/health")).json()
        assert (health["errors"], health["retried"], health["failed"]) == (1, 1, 0)


async def test_an_unreachable_service_is_tried_again_after_a_back_off_then_fails() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    scorer = scorer_for(RewardSpec.model_validate({"service": {"url": url}, "retries": 2}))
    assert isinstance(scorer, HttpRewardScorer) and not await scorer.ready()
    started = time.monotonic()
    results = await scorer.score_all(["1", "2"], "1")
    assert time.monotonic() - started >= 0.5 + 1.0  # two back-offs: 0.5 s, then 1 s
    assert (scorer.errors, scorer.retried) == (3, 2) and all(isinstance(r, RewardFailed) for r in results)
    assert str(results[0]).startswith(f"reward service {url} failed (3 tries): ConnectError")


async def test_a_worker_scoring_through_the_service_publishes_what_it_publishes_scoring_in_process(
        rollout_env, tmp_path: Path) -> None:
    redis, fake, names = rollout_env

    async def run(scorer) -> dict[tuple[str, int], float]:
        await redis.delete(*names.all_keys(), cursor_key(names, 0, 1))
        worker = make_worker(redis, fake, names, n=3, max_new=5, max_groups=4, scorer=scorer)
        await asyncio.wait_for(worker.run(), 60)
        return {(g.prompt_id, s.sample_index): s.reward for g in await published(redis, names) for s in g.samples}

    in_process = await run(RewardScorer(digit_sum_reward, 5.0))
    with reward_server(f"{PLUGINS}:digit_sum_reward", log=tmp_path / "server.log") as url:
        assert await run(HttpRewardScorer(url)) == in_process
    assert len(in_process) == 4 * 3 and len(set(in_process.values())) > 1

    # A service that cannot score some prompts: their groups are dropped, never published with a 0.
    with reward_server(f"{PLUGINS}:down_for_even_answers", log=tmp_path / "down.log") as url:
        await redis.delete(*names.all_keys(), cursor_key(names, 0, 1))
        worker = make_worker(redis, fake, names, n=3, max_new=5, max_groups=4, scorer=HttpRewardScorer(url))
        stats = await asyncio.wait_for(worker.run(), 60)
        groups = await published(redis, names)
    odd = {p for (p, _) in in_process if int(worker.prompts.pick(int(p.rsplit("-", 1)[1]))[1].answer) % 2}
    assert {g.prompt_id for g in groups} == odd and stats.groups_unscored == 4 - len(odd) > 0
    assert all(math.isfinite(s.reward) for g in groups for s in g.samples)
    assert (await worker.admission.snapshot()).reward_failures == 4 - len(odd)


def test_an_operator_run_service_needs_the_operator() -> None:
    from asyncrl.rollout.rewards.functions import RewardError

    spec = RewardSpec.model_validate({"service": {"deployment": {}}})
    with pytest.raises(RewardError, match=r"start `asyncrl reward-server` and set reward\.service\.url"):
        scorer_for(spec)
    scorer = scorer_for(spec, service_url="http://job-reward:8100")  # (the operator's ASYNCRL_REWARD_URL)
    assert isinstance(scorer, HttpRewardScorer) and scorer.url == "http://job-reward:8100"


def test_the_service_spec_names_the_field_and_what_it_accepts() -> None:
    from pydantic import ValidationError

    spec = RewardSpec.model_validate({"service": {"url": "http://rewards.rl.svc:8100/"}})
    assert spec.service is not None and spec.service.url == "http://rewards.rl.svc:8100"
    with pytest.raises(ValidationError, match=r"service\.url[\s\S]*not an http:// or https:// URL"):
        RewardSpec.model_validate({"service": {"url": "rewards:8100"}})
    with pytest.raises(ValidationError, match="maxConcurrentRequests"):
        RewardSpec.model_validate({"service": {"url": "http://x", "maxConcurrentRequests": 0}})
    with pytest.raises(ValidationError, match=r"exactly one of url \(an existing service\) and deployment"):
        RewardSpec.model_validate({"service": {"url": "http://x", "deployment": {}}})


@pytest.mark.slow
def test_a_local_run_trains_on_what_the_service_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      tiny_model_dir: Path) -> None:
    """`asyncrl run` with reward.service.url and a flaky verifier (every fourth call raises, groups of
    4): with the default reward.retries the job trains to the end on the service's rewards, the items
    that failed sent again and counted, and every reward the service gave is the one the function gives
    in-process on the same completion (on the two-layer model: the rewards' path, not what the model
    learns, is under test)."""
    record = tmp_path / "scored.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))  # (the reward server's environment)
    job = JobBuilder.small(name="t-reward-svc", batch_size=2, group_size=4, eta=1, max_steps=3, max_new_tokens=8,
                           model={"path": str(tiny_model_dir)})
    with reward_server(f"{PLUGINS}:recorded_flaky_length_reward", log=tmp_path / "server.log") as url:
        path = job.merge(reward={"function": "exact-number", "service": {"url": url}}).write(tmp_path / "job.yaml")
        run_dir = tmp_path / "run"
        proc = subprocess.run(ASYNCRL + ["run", str(path), "--max-steps", "3", "--run-dir", str(run_dir),
                                         "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        health = httpx.get(url + "/health").json()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3]
    scored = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(scored) >= 3 * 2 * 4  # (every trained sample, and those generated but not trained)
    assert all(s["score"] == length_reward(s["completion"], s["answer"]) for s in scored)
    given = {s["score"] for s in scored}
    assert len(given) > 1  # (varied rewards, not the exact-number function's 0s)
    # each step's mean reward is a mean of 8 of the service's rewards (multiples of 1/4)
    assert all(abs(m["reward_mean"] * 32 - round(m["reward_mean"] * 32)) < 1e-6 for m in lines)
    # the rollout worker's last summary counts the items it sent again: those the service failed
    # (on a second failure an item is not sent again: its group is dropped)
    worker_log = (run_dir / "logs" / "rollout-0.log").read_text()
    retries = [int(n) for n in re.findall(r"reward_retries=(\d+)", worker_log)]
    assert health["failed"] >= len(scored) // 4 > 0 and health["retried"] == 0, health
    assert retries and 0 < retries[-1] <= health["failed"], (health, worker_log[-2000:])
