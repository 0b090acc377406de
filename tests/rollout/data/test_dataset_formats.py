"""Dataset files (JSONL, Parquet, a Hugging Face dataset saved to disk), the column mapping, chats
rendered with the model's template, and metadata columns reaching the reward, in process and over HTTP.

Every file is written by the real library (json, pyarrow, `datasets.save_to_disk`) and read back by
the loaders the rollout worker uses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from asyncrl.api.spec import DatasetSpec
from asyncrl.rollout.data.datasets import DatasetError, ListSource, PromptItem, load_source
from asyncrl.rollout.data.prompts import PromptRenderer
from asyncrl.rollout.rewards.client import HttpRewardScorer
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.prompt_cursor import cursor_key
from tests.support.reward_services import bonus_reward, reward_server
from tests.support.rollout_workers import make_worker, published

PLUGINS = "tests.support.reward_services"
RECORDS = [
    {"id": "p0", "problem": "What is 2 + 2?", "solution": "4", "level": 1, "tests": ["4", "4.0"], "bonus": 0.25},
    {"id": "p1", "problem": "What is 3 * 5?", "solution": "15", "level": 2, "tests": ["15"], "bonus": 0.5},
    {"id": "p2", "problem": "What is 9 - 7?", "solution": "2", "level": 1, "tests": [], "bonus": 0.75},
]
MAPPED = {"prompt_field": "problem", "answer_field": "solution", "metadata_fields": ["level", "tests"]}
EXPECTED = [PromptItem(r["id"], r["problem"], r["solution"], metadata={"level": r["level"], "tests": r["tests"]})
            for r in RECORDS]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def save_dataset(path: Path, records: list[dict], num_shards: int = 1) -> Path:
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path), num_shards=num_shards)
    return path


def save_dataset_dict(path: Path, splits: dict[str, list[dict]]) -> Path:
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def items(source: str | Path, **spec) -> list[PromptItem]:
    """The file's items in file order (no shuffle)."""
    loaded = load_source(DatasetSpec(source=str(source), **spec))
    assert isinstance(loaded, ListSource)
    return loaded.items


# ------------------------------------------------------------------ formats


def test_every_format_reads_back_to_the_same_items(tmp_path: Path):
    files = [write_jsonl(tmp_path / "d.jsonl", RECORDS), write_parquet(tmp_path / "d.parquet", RECORDS),
             save_dataset(tmp_path / "saved", RECORDS), save_dataset(tmp_path / "sharded", RECORDS, num_shards=2),
             save_dataset_dict(tmp_path / "dict", {"train": RECORDS, "test": RECORDS[:1]})]
    assert len(list((tmp_path / "sharded").glob("*.arrow"))) == 2  # (the reader follows state.json's list)
    for path in files:
        assert items(path, **MAPPED) == EXPECTED, path.name
    assert items(tmp_path / "dict", split="test", **MAPPED) == EXPECTED[:1]
    # One source, shuffled the same way whatever the file it was read from.
    walks = [[load_source(DatasetSpec(source=str(p), seed=5, **MAPPED)).item(i) for i in range(7)] for p in files]
    assert all(walk == walks[0] for walk in walks)


def test_the_format_columns_and_default_ids_without_a_mapping(tmp_path: Path):
    gsm8k = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}]
    plain = [{"prompt": "2+2?", "answer": 4}, {"prompt": "3+3?", "answer": "6"}]  # (JSONL: any JSON answer)
    for writer, name in ((write_jsonl, "g.jsonl"), (write_parquet, "g.parquet")):
        [item] = items(writer(tmp_path / name, gsm8k))
        assert (item.question, item.answer, item.messages, item.metadata) == (gsm8k[0]["question"], "7", None, None)
    assert [(i.prompt_id, i.question, i.answer) for i in items(write_jsonl(tmp_path / "p.jsonl", plain))] == [
        ("p-1", "2+2?", "4"), ("p-2", "3+3?", "6")]  # (JSONL ids: the line number, as before)
    plain[0]["answer"] = "4"  # (an Arrow column has one type)
    assert [(i.prompt_id, i.answer) for i in items(save_dataset(tmp_path / "p", plain))] == [("p-0", "4"), ("p-1", "6")]
    saved_dict = save_dataset_dict(tmp_path / "dd", {"train": plain})
    assert [i.prompt_id for i in items(saved_dict)] == ["dd-train-0", "dd-train-1"]
    # A mapped answer column with format gsm8k is still cut at `####`.
    [item] = items(write_parquet(tmp_path / "m.parquet", [{"q": "x?", "sol": "so #### 1,200"}]),
                   format="gsm8k", prompt_field="q", answer_field="sol")
    assert (item.question, item.answer) == ("x?", "1200")


def test_columns_the_mapping_does_not_name_are_left_alone(tmp_path: Path):
    records = [dict(r, document="x" * 10_000) for r in RECORDS]
    for path in (write_parquet(tmp_path / "d.parquet", records), save_dataset(tmp_path / "saved", records)):
        assert items(path, **MAPPED) == EXPECTED


# ------------------------------------------------------------------ chats


def test_a_messages_column_is_rendered_with_the_models_chat_template(tmp_path: Path):
    from asyncrl.infra.hf_models import load_tokenizer

    chats = [
        {"id": "a", "answer": "3", "chat": [{"role": "system", "content": "You are a calculator."},
                                            {"role": "user", "content": "What is 1 + 2?"}]},
        {"id": "b", "answer": "8", "chat": [{"role": "user", "content": "What is 2 * 2?"},
                                            {"role": "assistant", "content": "4"},
                                            {"role": "user", "content": "And doubled?"}]},
    ]
    tok = load_tokenizer("embedded:SmolLM2-135M-Instruct")
    renderer = PromptRenderer(tok, template="{prompt} Answer with a number.", system_prompt="Be terse.")
    for path in (write_jsonl(tmp_path / "c.jsonl", chats), write_parquet(tmp_path / "c.parquet", chats),
                 save_dataset(tmp_path / "saved", chats)):
        a, b = items(path, messages_field="chat")
        assert (a.question, b.question) == ("What is 1 + 2?", "And doubled?")  # (logs, the reward's prompt)
        assert a.messages == chats[0]["chat"] and b.messages == chats[1]["chat"]
        # The chat's own system message wins; the template wraps the last user message only.
        expected_a = [chats[0]["chat"][0], {"role": "user", "content": "What is 1 + 2? Answer with a number."}]
        expected_b = [{"role": "system", "content": "Be terse."}, *chats[1]["chat"][:2],
                      {"role": "user", "content": "And doubled? Answer with a number."}]
        for item, expected in ((a, expected_a), (b, expected_b)):
            text = tok.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
            assert renderer.render(item) == tok(text, add_special_tokens=False)["input_ids"], path.name
        assert "You are a calculator." in tok.decode(renderer.render(a))
        assert "Be terse." not in tok.decode(renderer.render(a))
    # An item without a chat renders as before: system prompt, then its templated question.
    plain = PromptItem("q", "What is 1 + 2?", "3")
    assert renderer.render(plain) == renderer.render("What is 1 + 2?")
    assert renderer.messages(plain) == [{"role": "system", "content": "Be terse."},
                                        {"role": "user", "content": "What is 1 + 2? Answer with a number."}]


def test_held_out_chats_that_end_alike_are_distinct_prompts(tmp_path: Path):
    from asyncrl.rollout.evaluation.run_pass import eval_items

    chats = [{"answer": str(n), "chat": [{"role": "user", "content": f"Story {n}."},
                                         {"role": "assistant", "content": "Go on."},
                                         {"role": "user", "content": "How many words?"}]} for n in range(3)]
    source = load_source(DatasetSpec(source=str(write_jsonl(tmp_path / "c.jsonl", chats)), messages_field="chat"))
    assert sorted(i.answer for i in eval_items(source, 5)) == ["0", "1", "2"]


# ------------------------------------------------------------------ bad data


@pytest.mark.parametrize("writer, name", [(write_jsonl, "d.jsonl"), (write_parquet, "d.parquet"),
                                          (save_dataset, "saved")])
def test_a_missing_column_names_the_file_the_row_and_the_columns(tmp_path: Path, writer, name):
    records = [{"problem": "a?", "solution": "1"}, {"problem": "b?", "solution": "2"}]
    path = writer(tmp_path / name, records)
    first = f"{path}:1" if writer is write_jsonl else f"{path} row 0"
    with pytest.raises(DatasetError) as err:
        items(path)
    assert str(err.value) == f"{first}: no column 'prompt' (dataset.promptField); the columns: problem, solution"
    with pytest.raises(DatasetError, match=r"no column 'level' \(dataset\.metadataFields\); the columns: "
                                           r"problem, solution"):
        items(path, prompt_field="problem", answer_field="solution", metadata_fields=["level"])


def test_bad_values_name_the_row_and_the_column(tmp_path: Path):
    rows = [{"prompt": "a?", "answer": "1", "chat": [{"role": "user", "content": "a?"}]},
            {"prompt": "b?", "answer": None, "chat": [{"role": "user", "content": "b?"}]}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DatasetError, match=rf"^{path} row 1: column 'answer' is null$"):
        items(path)
    jsonl = write_jsonl(tmp_path / "d.jsonl", [rows[0], {"prompt": "c?", "answer": "3", "chat": "c?"},
                                               {"prompt": "d?", "answer": "4", "chat": []}])
    with pytest.raises(DatasetError, match=rf"^{jsonl}:2: column 'chat' must be a non-empty list of "
                                           r"\{role, content\} messages, got str 'c\?'"):
        items(jsonl, messages_field="chat")
    ends_with_answer = [{"answer": "1", "chat": [{"role": "user", "content": "a?"}, {"role": "assistant",
                                                                                     "content": "1"}]}]
    with pytest.raises(DatasetError, match=r"row 0: column 'chat' must end with a 'user' message .* got role "
                                           r"'assistant'"):
        items(save_dataset(tmp_path / "saved", ends_with_answer), messages_field="chat")
    no_content = write_jsonl(tmp_path / "n.jsonl", [{"answer": "1", "chat": [{"role": "user"}]}])
    with pytest.raises(DatasetError, match=r"n.jsonl:1: column 'chat' message 0 needs text 'role' and 'content'"):
        items(no_content, messages_field="chat")
    gsm8k = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(DatasetError, match=r"g.jsonl:1: column 'answer' \(format gsm8k\): no '#### <answer>' line"):
        items(gsm8k)


def test_paths_that_are_no_dataset_say_what_is_allowed(tmp_path: Path):
    allowed = "allowed: a .jsonl file, a .parquet file, or a directory written by a Hugging Face dataset's save_to_disk"
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=rf"unknown format '.csv'; {allowed}"):
        items(tmp_path / "d.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=rf"has neither state.json nor dataset_dict.json; {allowed}"):
        items(tmp_path / "empty")
    with pytest.raises(DatasetError, match="does not exist"):
        items(tmp_path / "missing.parquet")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: not a readable Parquet file"):
        items(tmp_path / "bad.parquet")
    splits = save_dataset_dict(tmp_path / "dict", {"train": RECORDS, "validation": RECORDS})
    with pytest.raises(DatasetError, match=r"dict: no split 'test'; allowed \(dataset.split\): train, validation"):
        items(splits, split="test", **MAPPED)
    saved = save_dataset(tmp_path / "saved", RECORDS)
    next(saved.glob("*.arrow")).write_bytes(b"truncated")
    with pytest.raises(DatasetError, match=r"data-00000-of-00001.arrow: not a readable Arrow stream file"):
        items(saved, **MAPPED)


@pytest.mark.parametrize("dataset, message", [
    ({"source": "/d.parquet", "promptField": "text", "messagesField": "chat"},
     "dataset.messagesField replaces promptField: set one of them, got promptField 'text' and messagesField "
     "'chat'; allowed: one of them, or neither"),
    ({"source": "builtin:arithmetic", "metadataFields": ["level"]},
     "metadataFields of builtin:arithmetic: builtin datasets have no columns to map"),
    ({"source": "/d.parquet", "metadataFields": ["level", "tests", "level"]},
     "metadataFields lists 'level' more than once; allowed: distinct column names"),
    ({"source": "/d.parquet", "answerField": ""}, "answerField\n  String should have at least 1 character"),
])
def test_the_spec_names_the_field_and_what_it_allows(dataset, message):
    with pytest.raises(ValidationError) as err:
        DatasetSpec.model_validate(dataset)
    assert message in str(err.value)


def test_the_mapping_is_camel_case_on_the_wire():
    spec = DatasetSpec.model_validate({"source": "/d.parquet", "messagesField": "chat", "answerField": "sol",
                                       "metadataFields": ["tests"]})
    assert (spec.messages_field, spec.answer_field, spec.metadata_fields) == ("chat", "sol", ["tests"])
    assert {"messagesField", "answerField", "metadataFields"} <= set(spec.to_wire())


# ------------------------------------------------------------------ metadata to the reward


async def test_a_plugin_is_given_metadata_only_when_it_asks_for_it():
    seen: list[tuple] = []

    def with_metadata(completion: str, answer: str, metadata: dict | None = None) -> float:
        seen.append((completion, answer, metadata))
        return 1.0 if completion in (metadata or {}).get("tests", []) else 0.0

    asking, plain = RewardScorer(with_metadata), RewardScorer(exact_number_reward)
    assert await asking.score_all(["4.0", "5"], "4", "What is 2 + 2?", metadata={"tests": ["4.0"]}) == [1.0, 0.0]
    assert await asking.score("4", "4") == 0.0
    assert await plain.score_all(["4", "5"], "4", metadata={"tests": ["5"]}) == [1.0, 0.0]  # (not given it)
    asking.close()
    plain.close()
    assert sorted(seen, key=str) == sorted([("4.0", "4", {"tests": ["4.0"]}), ("5", "4", {"tests": ["4.0"]}),
                                            ("4", "4", None)], key=str)


async def test_metadata_reaches_the_reward_server_and_is_left_out_when_there_is_none(tmp_path: Path):
    with reward_server(f"{PLUGINS}:bonus_reward", log=tmp_path / "bonus.log") as url:
        service = HttpRewardScorer(url, retries=0)
        assert await service.score_all(["1", "2"], "3", "q", metadata={"bonus": 0.25}) == [0.25, 0.25]
        [failed] = await service.score_all(["1"], "3")  # the plug-in wants metadata: it raises without
        assert "ValueError: no metadata" in str(failed)
    with reward_server(f"{PLUGINS}:digit_sum_reward", log=tmp_path / "plain.log") as url:
        service = HttpRewardScorer(url, retries=0)  # a plug-in without the parameter ignores it
        assert await service.score_all(["1"], "3", metadata={"bonus": 0.25}) == await service.score_all(["1"], "3")


async def test_a_worker_scores_a_files_rows_with_their_metadata_in_process_and_over_http(rollout_env, tmp_path: Path):
    """Parquet file -> items -> the worker's groups -> the reward's metadata: each published reward
    is the `bonus` column of its prompt's row, whether scored in process or by the service."""
    redis, fake, names = rollout_env
    path = write_parquet(tmp_path / "d.parquet", [dict(r, prompt=r["problem"], answer=r["solution"]) for r in RECORDS])
    source = load_source(DatasetSpec(source=str(path), metadata_fields=["bonus"]))
    bonus = {r["id"]: r["bonus"] for r in RECORDS}

    async def run(scorer) -> dict[str, set[float]]:
        await redis.delete(*names.all_keys(), cursor_key(names, 0, 1))
        worker = make_worker(redis, fake, names, n=2, max_new=3, max_groups=3, scorer=scorer, source=source)
        await asyncio.wait_for(worker.run(), 60)
        rewards: dict[str, set[float]] = {}
        for group in await published(redis, names):
            rewards.setdefault(group.prompt_id, set()).update(s.reward for s in group.samples)
        return rewards

    in_process = await run(RewardScorer(bonus_reward, 5.0, on_error="drop"))
    assert in_process and all(got == {bonus[p]} for p, got in in_process.items())
    with reward_server(f"{PLUGINS}:bonus_reward", log=tmp_path / "server.log") as url:
        assert await run(HttpRewardScorer(url)) == in_process
