"""Local dataset files as rows: JSONL, Parquet, and a Hugging Face dataset saved with `save_to_disk`.

The path tells the format: `*.jsonl`, `*.parquet`, or a directory holding `state.json` (written by
`Dataset.save_to_disk`) or `dataset_dict.json` (`DatasetDict.save_to_disk`: one directory per
split). A saved dataset is Arrow IPC stream files, listed in its `state.json` (`_data_files`), so
pyarrow reads it without the `datasets` library: the rollout image needs pyarrow only.

Each row says where it is (`file:line`, `file row n`, 0-based like `dataset[n]`) for error messages.
Of a columnar file only the columns asked for are read (a column of long documents the prompts do not
use is never loaded), but a row knows every column the file has, so an error can list them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.infra.errors import RolloutError

FORMS = "a .jsonl file, a .parquet file, or a directory written by a Hugging Face dataset's save_to_disk"
STATE_JSON = "state.json"
DATASET_DICT_JSON = "dataset_dict.json"


class DatasetError(RolloutError, ValueError):
    """A dataset that cannot be read; the message says which file/row or what to install."""


@dataclass(frozen=True)
class Row:
    """One record and where it came from."""

    where: str
    """`file:line` or `file row n`, for error messages."""
    default_id: str
    """Its prompt id when the record has no `id`."""
    record: dict[str, Any]
    """The columns asked for that the file has (a JSONL record: all of them)."""
    columns: tuple[str, ...]
    """Every column of the file (of a JSONL record: its keys)."""


def read_rows(path: str | Path, *, split: str, wanted: Collection[str]) -> Iterator[Row]:
    """The rows of a local dataset (format by the path, see the module doc); `wanted`: the columns
    to read from a columnar file, where present. A DatasetDict gives its `split`."""
    path = Path(path)
    if path.is_dir():
        return _saved_rows(path, split, wanted)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            columns = tuple(pq.read_schema(path).names)
            table = pq.read_table(path, columns=[c for c in columns if c in wanted])
        except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ...
            raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from exc
        return _table_rows(table, columns, str(path), path.stem)
    raise DatasetError(f"dataset file {path}: unknown format {path.suffix or '(no suffix)'!r}; allowed: {FORMS}")


def _jsonl_rows(path: Path) -> Iterator[Row]:
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
            yield Row(f"{path}:{n}", f"{path.stem}-{n}", record, tuple(record))


def _saved_rows(path: Path, split: str, wanted: Collection[str]) -> Iterator[Row]:
    """A `save_to_disk` directory: a Dataset (state.json), or a DatasetDict's `split`."""
    name = path.name
    if (path / DATASET_DICT_JSON).is_file():
        splits = _json(path / DATASET_DICT_JSON).get("splits")
        if not isinstance(splits, list):
            raise DatasetError(f"{path / DATASET_DICT_JSON}: no list of splits")
        if split not in splits:
            raise DatasetError(f"{path}: no split {split!r}; allowed (dataset.split): {', '.join(map(str, splits))}")
        path, name = path / split, f"{name}-{split}"
    if not (path / STATE_JSON).is_file():
        raise DatasetError(f"dataset directory {path} has neither {STATE_JSON} nor {DATASET_DICT_JSON}; "
                           f"allowed: {FORMS}")
    files = _json(path / STATE_JSON).get("_data_files")
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise DatasetError(f"{path / STATE_JSON}: no `_data_files` list of Arrow files")
    import pyarrow as pa

    tables = []
    for entry in files:
        shard = path / str(entry["filename"])
        try:
            with pa.memory_map(str(shard)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except Exception as exc:  # missing, truncated, not Arrow
            raise DatasetError(f"{shard}: not a readable Arrow stream file: {exc}") from exc
    try:
        table = pa.concat_tables(tables)
    except Exception as exc:  # shards of different schemas
        raise DatasetError(f"{path}: its Arrow files do not make one table: {exc}") from exc
    columns = tuple(table.column_names)
    return _table_rows(table.select([c for c in columns if c in wanted]), columns, str(path), name)


def _table_rows(table: Any, columns: tuple[str, ...], where: str, name: str) -> Iterator[Row]:
    """Rows of an Arrow table (Python values, e.g. a list of structs becomes a list of dicts)."""
    n = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            yield Row(f"{where} row {n}", f"{name}-{n}", record, columns)
            n += 1


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise DatasetError(f"{path}: not a JSON object")
    return value
