"""Prompt sources: JSONL files, Hugging Face datasets, and the seeded `builtin:arithmetic` generator.

Every source is indexable by a global position (`item(g)`), which makes sharding and resuming
trivial and deterministic: replica r of R takes positions r, r + R, r + 2R, ... (`ShardCursor`),
and a finite dataset is walked in epochs, each a fresh seeded permutation. The position of the
next prompt is all the state a worker needs to resume (persisted in Redis by the worker).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from asyncrl.errors import RolloutError
from asyncrl.spec import DatasetSpec

DEFAULT_ARITHMETIC_INSTRUCTION = "Answer with just the final number."


class DatasetError(RolloutError, ValueError):
    """A dataset that cannot be read; the message says which file/line or what to install."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt: a stable id, the question text (before the chat template) and the reference answer."""

    prompt_id: str
    question: str
    answer: str


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


# ----------------------------------------------------------------------------- JSONL


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K reference solutions end with `#### <number>`."""
    if "####" not in solution:
        raise ValueError("no '#### <answer>' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def parse_record(record: dict, fmt: str, where: str) -> tuple[str, str]:
    """(question, answer) of one JSONL record in format gsm8k | prompt-answer | auto."""
    if fmt == "auto":
        fmt = "gsm8k" if "question" in record else "prompt-answer"
    if fmt == "gsm8k":
        if not isinstance(record.get("question"), str) or not isinstance(record.get("answer"), str):
            raise DatasetError(f"{where}: gsm8k records need string fields 'question' and 'answer'")
        try:
            return record["question"], gsm8k_final_answer(record["answer"])
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}") from None
    if "prompt" not in record or "answer" not in record:
        raise DatasetError(f"{where}: prompt-answer records need fields 'prompt' and 'answer' (got {sorted(record)})")
    return str(record["prompt"]), str(record["answer"])


def load_jsonl(path: str | Path, fmt: str = "auto") -> list[PromptItem]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    items = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{n}: each line must be a JSON object")
            question, answer = parse_record(record, fmt, f"{path}:{n}")
            items.append(PromptItem(str(record.get("id", f"{path.stem}-{n}")), question, answer))
    return items


def load_hf(dataset_id: str, split: str, fmt: str) -> list[PromptItem]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset 'hf:{dataset_id}' needs the Hugging Face `datasets` library (pip install datasets) "
            "and network access to the hub; or give a local JSONL path") from None
    name, _, config = dataset_id.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:
        raise DatasetError(f"cannot load Hugging Face dataset {dataset_id!r} split {split!r}: {exc}") from exc
    items = []
    for n, record in enumerate(ds):
        question, answer = parse_record(dict(record), fmt, f"hf:{dataset_id}[{n}]")
        items.append(PromptItem(f"{name}-{split}-{n}", question, answer))
    return items


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
        return ListSource(load_hf(src.removeprefix("hf:"), spec.split, spec.format), seed=spec.seed)
    return ListSource(load_jsonl(src, spec.format), seed=spec.seed)


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
