"""Prompt sources, sharding and chat-template rendering."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import pytest

from asyncrl.api.spec import DatasetSpec
from asyncrl.rollout.data.datasets import ArithmeticSource, DatasetError, ShardCursor, load_jsonl, load_source
from asyncrl.rollout.rewards.functions import exact_number_reward
from tests.conftest import SHARED_DIR

GSM8K_TEST = SHARED_DIR / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not found (set ASYNCRL_SHARED_DIR)")
def test_gsm8k_jsonl():
    items = load_jsonl(GSM8K_TEST)
    assert len(items) == 1319
    assert items[0].question.startswith("Janet") and items[0].answer == "18"
    src = load_source(DatasetSpec(source=str(GSM8K_TEST), format="gsm8k", seed=3))
    first_epoch = {src.item(i).prompt_id for i in range(1319)}
    assert len(first_epoch) == 1319  # a permutation per epoch
    assert [src.item(i) for i in range(5)] == [load_source(DatasetSpec(source=str(GSM8K_TEST), seed=3)).item(i)
                                               for i in range(5)]


def test_prompt_answer_jsonl_and_errors(tmp_path: Path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"prompt": "2+2?", "answer": 4}) + "\n\n"
                    + json.dumps({"prompt": "3+3?", "answer": "6"}))
    items = load_jsonl(good)
    assert [(i.question, i.answer) for i in items] == [("2+2?", "4"), ("3+3?", "6")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\nnot json\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2"):
        load_jsonl(bad)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(DatasetError, match="####"):
        load_jsonl(wrong)
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_hf_ids_need_the_datasets_library(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DatasetError, match="pip install datasets"):
        load_source(DatasetSpec(source="hf:openai/gsm8k:main"))


def test_builtin_arithmetic_is_seeded_and_level_one_is_two_digit_addition():
    src = ArithmeticSource(seed=7, difficulty=1)
    again = ArithmeticSource(seed=7, difficulty=1)
    for i in range(50):
        item = src.item(i)
        assert item == again.item(i)
        x, y = map(int, re.match(r"What is (\d+) \+ (\d+)\?", item.question).groups())
        assert 10 <= x <= 99 and 10 <= y <= 99 and item.answer == str(x + y)
    assert src.item(0) != ArithmeticSource(seed=8, difficulty=1).item(0)
    for level in range(1, 6):
        s = ArithmeticSource(seed=1, difficulty=level)
        for i in range(20):
            item = s.item(i)
            expr = re.search(r"What is (.+)\?", item.question)
            if expr:  # levels 1-4 are expressions: the answer is their value
                assert str(eval(expr.group(1))) == item.answer
            assert exact_number_reward(item.answer, item.answer) == 1.0
    with pytest.raises(DatasetError):
        ArithmeticSource(difficulty=6)


def test_shard_cursor_partitions_positions():
    shards = [ShardCursor(i, 3) for i in range(3)]
    taken = [s.take()[1] for _ in range(4) for s in shards]
    assert sorted(taken) == list(range(12))
    with pytest.raises(ValueError):
        ShardCursor(3, 3)


def test_chat_template_rendering():
    from asyncrl.infra.hf_models import load_tokenizer
    from asyncrl.rollout.data.prompts import PromptRenderer

    tok = load_tokenizer("embedded:SmolLM2-135M-Instruct")
    r = PromptRenderer(tok, template="Solve: {prompt}", system_prompt="You are terse.")
    text = tok.decode(r.render("What is 1 + 2?"))
    assert "You are terse." in text and "Solve: What is 1 + 2?" in text
    assert text.rstrip().endswith("assistant")
    assert tok.convert_tokens_to_ids("<|im_end|>") in r.stop_token_ids()
    with pytest.raises(ValueError):
        PromptRenderer(tok, template="no placeholder")
