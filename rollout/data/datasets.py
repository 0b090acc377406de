"""Prompt sources: local files (JSONL, Parquet, a saved Hugging Face dataset), Hugging Face dataset
ids, and the seeded `builtin:arithmetic` generator.

Every source is indexable by a global position (`item(g)`), which makes sharding and resuming
trivial and deterministic: replica r of R takes positions r, r + R, r + 2R, ... (`ShardCursor`),
and a finite dataset is walked in epochs, each a fresh seeded permutation. The position of the
next prompt is all the state a worker needs to resume (persisted in Redis by the worker).

A record becomes a PromptItem through the spec's format and column mapping (`Columns`); a record
that does not fit is an error naming the file, the row and the column, with the columns it has.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from asyncrl.api.spec import DatasetSpec
from asyncrl.rollout.data.files import DatasetError, Row, read_rows

DEFAULT_ARITHMETIC_INSTRUCTION = "Answer with just the final number."


@dataclass(frozen=True)
class PromptItem:
    """One prompt: a stable id, the question text (before the chat template) and the reference answer.

    `messages`: the chat to render instead of the question (dataset.messagesField; the question is
    then its last user message, what logs and the reward's `prompt` show). `metadata`: the columns
    the reward is given (dataset.metadataFields)."""

    prompt_id: str
    question: str
    answer: str
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, Any] | None = None


class PromptSource(Protocol):
    def item(self, position: int) -> PromptItem: ...

    def __len__(self) -> int: ...


class ListSource:
    """A finite list walked in seeded, per-epoch shuffled order."""

    def __init__(self, items: list[PromptItem], seed: int = 0, shuffle: bool = True):
        if not items:
            raise DatasetError("the dataset has no records")
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep only the current epoch
        return self._orders[epoch]

    def item(self, position: int) -> PromptItem:
        epoch, offset = divmod(position, len(self.items))
        return self.items[self._order(epoch)[offset]]


# ----------------------------------------------------------------------------- records -> items


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K reference solutions end with `#### <number>`."""
    if "####" not in solution:
        raise ValueError("no '#### <answer>' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass(frozen=True)
class Columns:
    """Which columns of a record make a PromptItem: DatasetSpec's format and column mapping."""

    format: str = "auto"
    prompt: str | None = None
    answer: str | None = None
    messages: str | None = None
    metadata: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec: DatasetSpec) -> Columns:
        return cls(spec.format, spec.prompt_field, spec.answer_field, spec.messages_field,
                   tuple(spec.metadata_fields))

    def wanted(self) -> set[str]:
        """Every column a record may be read from (whichever the format turns out to be)."""
        if self.messages:
            prompts = {self.messages}
        else:
            prompts = {self.prompt} if self.prompt else {"question", "prompt"}
        return prompts | {self.answer or "answer", "id", *self.metadata}

    def layout(self, columns: Iterable[str]) -> tuple[str, str | None]:
        """(format, prompt column) of a record with these columns: auto is gsm8k when no column is
        mapped and the record has `question`; with messages there is no prompt column."""
        fmt = self.format
        if fmt == "auto":
            mapped = self.prompt or self.answer or self.messages
            fmt = "gsm8k" if not mapped and "question" in columns else "prompt-answer"
        if self.messages:
            return fmt, None
        return fmt, self.prompt or ("question" if fmt == "gsm8k" else "prompt")

    def item(self, row: Row) -> PromptItem:
        """The PromptItem of a row, or DatasetError naming the row and the column."""
        fmt, prompt_column = self.layout(row.columns)
        messages = None
        if self.messages:
            messages = chat_messages(row, self.messages)
            question = messages[-1]["content"]
        else:
            assert prompt_column is not None  # (layout: a prompt column unless messages)
            question = _value(row, prompt_column, "promptField")
            question = _text(row, prompt_column, question) if fmt == "gsm8k" else str(question)
        answer_column = self.answer or "answer"
        answer = _value(row, answer_column, "answerField")
        if fmt == "gsm8k":
            try:
                answer = gsm8k_final_answer(_text(row, answer_column, answer))
            except ValueError as exc:
                raise DatasetError(f"{row.where}: column {answer_column!r} (format gsm8k): {exc}") from None
        metadata = {c: _value(row, c, "metadataFields", null=True) for c in self.metadata} or None
        record_id = row.record.get("id")
        return PromptItem(row.default_id if record_id is None else str(record_id), question, str(answer),
                          messages, metadata)


def _value(row: Row, column: str, field: str, *, null: bool = False) -> Any:
    if column not in row.record:
        raise DatasetError(f"{row.where}: no column {column!r} (dataset.{field}); the columns: "
                           f"{', '.join(row.columns) or '(none)'}")
    value = row.record[column]
    if value is None and not null:
        raise DatasetError(f"{row.where}: column {column!r} is null")
    return value


def _text(row: Row, column: str, value: Any) -> str:
    if not isinstance(value, str):
        raise DatasetError(f"{row.where}: column {column!r} must be text, got {type(value).__name__}")
    return value


def chat_messages(row: Row, column: str) -> list[dict[str, str]]:
    """The chat in `column`: a non-empty list of {role, content} (other keys dropped) ending with
    the user's message, which the model answers."""
    value = _value(row, column, "messagesField")
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{row.where}: column {column!r} must be a non-empty list of {{role, content}} "
                           f"messages, got {type(value).__name__} {str(value)[:80]!r}")
    for n, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DatasetError(f"{row.where}: column {column!r} message {n} needs text 'role' and 'content', "
                               f"got {str(message)[:80]!r}")
    if value[-1]["role"] != "user":
        raise DatasetError(f"{row.where}: column {column!r} must end with a 'user' message (the model answers "
                           f"it), got role {value[-1]['role']!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_file(path: str | Path, columns: Columns | None = None, split: str = "train") -> list[PromptItem]:
    """Every record of a local dataset (dataset_files.read_rows: JSONL, Parquet, save_to_disk)."""
    columns = columns or Columns()
    return [columns.item(row) for row in read_rows(path, split=split, wanted=columns.wanted())]


def load_jsonl(path: str | Path, fmt: str = "auto") -> list[PromptItem]:
    return load_file(path, Columns(fmt))


def load_hf(dataset_id: str, split: str, columns: Columns, revision: str | None = None) -> list[PromptItem]:
    """A hub dataset's split (`revision`: dataset.revision, a commit sha, tag or branch of its repository)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset 'hf:{dataset_id}' needs the Hugging Face `datasets` library (pip install datasets) "
            "and network access to the hub; or give a local file") from None
    name, _, config = dataset_id.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split, revision=revision)
    except Exception as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise DatasetError(f"cannot load Hugging Face dataset {dataset_id!r} split {split!r}{at}: {exc}") from exc
    names = tuple(ds.column_names)
    return [columns.item(Row(f"hf:{dataset_id}[{n}]", f"{name}-{split}-{n}", dict(record), names))
            for n, record in enumerate(ds)]


# ----------------------------------------------------------------------------- builtin:arithmetic


class ArithmeticSource:
    """Seeded, infinite arithmetic problems; item(g) depends only on (seed, difficulty, g).

    difficulty 1: two-digit addition ("What is 23 + 45?"); 2: two- and three-digit addition and
    subtraction; 3: two-digit times one-digit; 4: two operations; 5: a short word problem with
    three steps.
    """

    NAMES: ClassVar[tuple[str, ...]] = ("Ann", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Ivy")
    THINGS: ClassVar[tuple[str, ...]] = ("apples", "books", "marbles", "stamps", "coins", "shells")

    TEST_BUCKETS: ClassVar[int] = 10
    """One problem in this many (by a stable hash of its text) belongs to split test, the rest to
    train: the two splits never share a problem, whatever the seeds."""

    def __init__(self, seed: int = 0, difficulty: int = 1, instruction: str = DEFAULT_ARITHMETIC_INSTRUCTION,
                 split: str = "train"):
        if not 1 <= difficulty <= 5:
            raise DatasetError(f"builtin:arithmetic difficulty must be 1..5, got {difficulty}")
        if split not in ("train", "test"):
            raise DatasetError(f"builtin:arithmetic split must be train or test, got {split!r}")
        self.seed, self.difficulty, self.instruction, self.split = seed, difficulty, instruction, split

    def __len__(self) -> int:
        return 2**31 - 1

    @classmethod
    def split_of(cls, question: str) -> str:
        return "test" if zlib.crc32(question.encode()) % cls.TEST_BUCKETS == 0 else "train"

    def item(self, position: int) -> PromptItem:
        tag = "" if self.split == "train" else f"{self.split}:"
        rng = random.Random(f"arith:{tag}{self.seed}:{self.difficulty}:{position}")
        while True:  # draw until the problem is of this split (same rng: deterministic)
            q, a = getattr(self, f"_level{self.difficulty}")(rng)
            if self.split_of(q) == self.split:
                break
        text = f"{q} {self.instruction}".strip()
        return PromptItem(f"arith-{tag.replace(':', '-')}{self.seed}-{self.difficulty}-{position}", text, str(a))

    def _level1(self, rng: random.Random) -> tuple[str, int]:
        x, y = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {x} + {y}?", x + y

    def _level2(self, rng: random.Random) -> tuple[str, int]:
        x, y = rng.randint(10, 999), rng.randint(10, 999)
        if rng.random() < 0.5:
            return f"What is {x} + {y}?", x + y
        x, y = max(x, y), min(x, y)
        return f"What is {x} - {y}?", x - y

    def _level3(self, rng: random.Random) -> tuple[str, int]:
        x, y = rng.randint(10, 99), rng.randint(2, 9)
        return f"What is {x} * {y}?", x * y

    def _level4(self, rng: random.Random) -> tuple[str, int]:
        x, y, z = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"What is {x} * {y} + {z}?", x * y + z
        return f"What is ({x} + {z}) * {y}?", (x + z) * y

    def _level5(self, rng: random.Random) -> tuple[str, int]:
        name, thing = rng.choice(self.NAMES), rng.choice(self.THINGS)
        start, boxes, per_box, given = rng.randint(5, 60), rng.randint(2, 6), rng.randint(3, 12), rng.randint(1, 20)
        q = (f"{name} has {start} {thing}. {name} buys {boxes} boxes with {per_box} {thing} each, "
             f"then gives away {given}. How many {thing} does {name} have now?")
        return q, start + boxes * per_box - given


# ----------------------------------------------------------------------------- entry points


def load_source(spec: DatasetSpec) -> PromptSource:
    """The prompt source a DatasetSpec names."""
    src = spec.source
    if src == "builtin:arithmetic":
        return ArithmeticSource(seed=spec.seed, difficulty=spec.difficulty, split=spec.split)
    if src.startswith("builtin:"):
        raise DatasetError(f"unknown builtin dataset {src!r}; allowed: builtin:arithmetic")
    if src.startswith("hf:"):
        return ListSource(load_hf(src.removeprefix("hf:"), spec.split, Columns.of(spec), spec.revision), seed=spec.seed)
    return ListSource(load_file(src, Columns.of(spec), spec.split), seed=spec.seed)


@dataclass
class ShardCursor:
    """Replica `index` of `replicas` walks positions index, index + replicas, ...; `next` is local."""

    index: int = 0
    replicas: int = 1
    next: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or not 0 <= self.index < self.replicas:
            raise ValueError(f"shard index {self.index} is not within 0..{self.replicas - 1}")

    def position(self, local: int) -> int:
        return local * self.replicas + self.index

    def take(self) -> tuple[int, int]:
        """(local index, global position) of the next prompt; advances the cursor."""
        local = self.next
        self.next += 1
        return local, self.position(local)
