"""A judge model as the reward (spec.reward.judge): the request it is sent, how its reply is read, the
spec's rules, and the scorer against a real vLLM-CPU OpenAI server (marker `vllm`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.api.spec import JudgeSpec, RewardSpec
from asyncrl.infra.net import free_port
from asyncrl.rollout.rewards.functions import RewardFailed
from asyncrl.rollout.rewards.judge import JudgeScorer, judge_request, parse_score, reply_text
from asyncrl.rollout.rewards.scorers import scorer_for


def judge(**fields: object) -> JudgeSpec:
    return JudgeSpec.model_validate({"url": "http://judge:8000/v1", "model": "m", **fields})


def test_the_request_asks_for_a_score_in_range_with_the_template_filled_in() -> None:
    body = judge_request(judge(promptTemplate="Q: {prompt} | A: {completion} | ref {answer} | 0..{max_score}",
                               systemPrompt="Be strict.", maxScore=5),
                         completion="42", answer="42", prompt="What is 40 + 2?")
    assert body["model"] == "m" and body["temperature"] == 0.0 and body["max_tokens"] == 32
    assert body["messages"] == [{"role": "system", "content": "Be strict."},
                                {"role": "user", "content": "Q: What is 40 + 2? | A: 42 | ref 42 | 0..5"}]
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["score"] == {"type": "integer", "minimum": 0, "maximum": 5}
    free = judge_request(judge(structuredOutput=False), completion="x", answer="y", prompt="z")
    assert "response_format" not in free and len(free["messages"]) == 1
    assert "x" in free["messages"][0]["content"] and "10" in free["messages"][0]["content"]  # (the default template)


@pytest.mark.parametrize(("reply", "structured", "reward"), [
    ('{"score": 7}', True, 0.7), ('{\n  "score": 10\n}', True, 1.0), ('{"score": 0}', True, 0.0),
    ("Score: 8", False, 0.8), ("I'd say 3 out of 10... no, 6", False, 0.6)])
def test_a_score_in_range_is_the_reward_scaled(reply: str, structured: bool, reward: float) -> None:
    assert parse_score(reply, max_score=10, structured=structured) == pytest.approx(reward)


@pytest.mark.parametrize(("reply", "structured", "problem"), [
    ('{"score": 11}', True, "outside 0..10"), ('{"score": -1}', True, "outside 0..10"),
    ('{"score": 7.5}', True, "no integer `score`"), ('{"verdict": 7}', True, "no integer `score`"),
    ("seven", True, "not the JSON asked for"), ("seven", False, "no score in the reply"),
    ("7.5", False, "no score in the reply"), ("12", False, "outside 0..10")])
def test_a_reply_without_a_score_in_range_is_an_error(reply: str, structured: bool, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_score(reply, max_score=10, structured=structured)


def test_only_a_chat_completion_has_a_reply() -> None:
    assert reply_text({"choices": [{"message": {"content": "9"}}]}) == "9"
    for body in ({}, {"choices": []}, {"choices": [{"message": {"content": None}}]}, []):
        with pytest.raises(ValueError):
            reply_text(body)


def test_the_spec_names_what_is_wrong() -> None:
    with pytest.raises(ValidationError, match=r"needs \{completion\}"):
        judge(promptTemplate="Rate {prompt}")
    with pytest.raises(ValidationError, match="unknown: question"):
        judge(promptTemplate="{question}: {completion}")
    with pytest.raises(ValidationError, match="not an http"):
        judge(url="judge:8000")
    with pytest.raises(ValidationError, match="one of service and judge"):
        RewardSpec.model_validate({"service": {"url": "http://r:8100"},
                                   "judge": {"url": "http://j/v1", "model": "m"}})
    assert judge(url="http://judge:8000/v1/").url == "http://judge:8000/v1"


async def test_an_unreachable_judge_fails_the_reward_after_its_retries() -> None:
    spec = RewardSpec.model_validate({"judge": {"url": f"http://127.0.0.1:{free_port()}/v1", "model": "m"},
                                      "retries": 1})
    scorer = scorer_for(spec)
    assert isinstance(scorer, JudgeScorer) and not await scorer.ready()
    [failed] = await scorer.score_all(["42"], "42", "What is 40 + 2?")
    assert isinstance(failed, RewardFailed) and "failed (2 tries)" in str(failed)
    assert (scorer.errors, scorer.failed) == (2, 1)
    zero = scorer_for(spec, on_error="zero")  # (held-out evaluation scores a failed reward 0)
    assert await zero.score("42", "42") == 0.0
