"""Reward functions: GSM8K over the whole test split, exact-number, plug-ins, errors and timeouts."""

from __future__ import annotations

import json
import logging
import sys
import threading
import types

import pytest

from asyncrl.rollout.rewards.functions import (
    RewardError,
    RewardFailed,
    RewardScorer,
    exact_number_reward,
    extract_answer,
    gsm8k_reward,
    resolve_reward,
)
from tests.conftest import SHARED_DIR

GSM8K_TEST = SHARED_DIR / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not found (set ASYNCRL_SHARED_DIR)")
def test_gsm8k_gold_scores_one_and_wrong_scores_zero_on_all_1319_items():
    records = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(records) == 1319
    gold_fail, wrong_pass = [], []
    for n, rec in enumerate(records):
        ref = rec["answer"]
        gold = extract_answer(ref)
        if gsm8k_reward(ref, ref) != 1.0:
            gold_fail.append(n)
        wrong = f"{float(gold.replace(',', '')) + 1:g}"
        if gsm8k_reward(f"Let me think. The answer is {wrong}.", ref) != 0.0:
            wrong_pass.append(n)
    assert gold_fail == [] and wrong_pass == []


@pytest.mark.parametrize("completion,score", [
    ("So she makes 9 * 2 = 18 dollars.\n#### 18", 1.0),
    ("The answer is $\\boxed{18}$", 1.0),
    ("the answer is 18.", 1.0),
    ("It is 18.0 in total", 1.0),
    ("I think 1,8 then 17", 0.0),
    ("no number here", 0.0),
])
def test_gsm8k_extraction(completion, score):
    assert gsm8k_reward(completion, "blah <<9*2=18>>18\n#### 18") == score


def test_exact_number():
    assert exact_number_reward("23 + 45 = 68", "68") == 1.0
    assert exact_number_reward("68, no wait, 69", "68") == 0.0
    assert exact_number_reward("The total is 1,234.", "1234") == 1.0
    assert exact_number_reward("", "3") == 0.0


def test_plugins_resolve_and_bad_names_explain(monkeypatch):
    mod = types.ModuleType("my_rewards_for_test")
    mod.length_reward = lambda completion, answer: len(completion) / 10
    monkeypatch.setitem(sys.modules, "my_rewards_for_test", mod)
    assert resolve_reward("my_rewards_for_test:length_reward")("abcde", "") == 0.5
    assert resolve_reward("gsm8k") is gsm8k_reward
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="no function"):
        resolve_reward("my_rewards_for_test:missing")
    with pytest.raises(RewardError, match="allowed"):
        resolve_reward("bleu")


async def test_with_on_error_zero_raising_timing_out_and_nan_rewards_score_zero_and_are_counted(caplog):
    release = threading.Event()

    def flaky(completion: str, answer: str) -> float:
        if completion == "raise":
            raise RuntimeError("boom")
        if completion == "hang":
            release.wait(10)
            return 1.0
        if completion == "nan":
            return float("nan")
        return 1.0

    scorer = RewardScorer(flaky, timeout_s=0.2, name="flaky", on_error="zero")
    with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.rewards.functions"):
        assert await scorer.score("ok", "") == 1.0
        assert await scorer.score("raise", "") == 0.0
        assert await scorer.score("hang", "") == 0.0
        assert await scorer.score("nan", "") == 0.0
    release.set()
    assert (scorer.errors, scorer.timeouts, scorer.failed, scorer.scored) == (3, 1, 3, 4)
    assert "boom" in caplog.text and "timed out" in caplog.text and "not finite" in caplog.text
    assert caplog.text.count("scored 0: reward.onError is zero") == 3
    scorer.close()


async def test_a_failed_call_is_tried_again_and_a_reward_failing_every_try_is_raised_not_scored():
    tries: dict[str, int] = {}

    def verifier(completion: str, answer: str) -> float:
        tries[completion] = tries.get(completion, 0) + 1
        if completion == "down" or tries[completion] == 1:  # "down" always fails, the rest fail once
            raise ConnectionError("verifier unreachable")
        return 1.0

    scorer = RewardScorer(verifier, timeout_s=5.0, name="verifier", retries=2, on_error="drop")
    assert await scorer.score("flaky", "") == 1.0
    with pytest.raises(RewardFailed, match=r"^reward 'verifier' failed \(3 tries\): "
                                           r"ConnectionError: verifier unreachable$"):
        await scorer.score("down", "")
    assert tries == {"flaky": 2, "down": 3}
    assert (scorer.errors, scorer.failed, scorer.scored) == (1 + 3, 1, 2)
    scorer.close()


def test_the_spec_drops_by_default_and_names_the_allowed_values() -> None:
    from pydantic import ValidationError

    from asyncrl.api.spec import RewardSpec

    assert (RewardSpec().on_error, RewardSpec().retries) == ("drop", 1)
    assert RewardSpec.model_validate({"onError": "zero", "retries": 0}).on_error == "zero"
    with pytest.raises(ValidationError, match="onError") as err:
        RewardSpec.model_validate({"onError": "ignore"})
    assert "'drop' or 'zero'" in str(err.value)
    with pytest.raises(ValidationError, match="retries"):
        RewardSpec.model_validate({"retries": 11})
