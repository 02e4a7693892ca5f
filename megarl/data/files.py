"""Reading and writing record files (.jsonl, .parquet, .json) row by row, with errors that name file and row.

Rows are numbered from 1 (for .jsonl, the line number; blank lines are skipped but keep their numbers).
Text is decoded row by row, so a row that is not valid UTF-8 is one malformed row, not a failed file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

SUFFIXES = (".jsonl", ".parquet", ".json")
LONE_SURROGATE = "holds a lone surrogate escape (\\ud800-\\udfff): not valid Unicode"
# a JSON escape of a UTF-16 surrogate: valid JSON, but alone (not in a pair) it is no character a tokenizer takes
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class InputError(ValueError):
    """An input file (prompt file, model directory) that cannot be used; the message names the file."""


class MalformedRow(InputError):
    """A row that cannot be used; the message names the file and the row."""

    def __init__(self, path: Path | str, row: int, problem: str):
        super().__init__(f"{path}, row {row}: {problem}")
        self.path, self.row, self.problem = str(path), row, problem


def iter_records(path: str | Path) -> Iterator[tuple[int, dict | MalformedRow]]:
    """(row number, record) for each row; a row that is not a JSON object, or not valid UTF-8, comes as a
    MalformedRow instead, so a caller can stop on it or skip it. A .json file holds one object or a list of
    them. A file that cannot be read at all (a truncated parquet file) raises InputError naming it."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise InputError(f"{path}: record files must be {', '.join(SUFFIXES)}")
    if not path.exists():
        raise InputError(f"record file not found: {path}")
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
    elif path.suffix == ".json":
        yield from _json_records(path)
    else:
        yield from _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict | MalformedRow]]:
    with path.open("rb") as f:
        for row, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield row, MalformedRow(path, row, f"not valid UTF-8 (byte {e.object[e.start]:#04x} at column "
                                                   f"{e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield row, MalformedRow(path, row, f"not valid JSON ({e.msg})")
                continue
            if _SURROGATE_ESCAPE.search(line) and _has_lone_surrogate(record):
                yield row, MalformedRow(path, row, LONE_SURROGATE)
                continue
            yield row, _object_or_malformed(path, row, record)


def _json_records(path: Path) -> Iterator[tuple[int, dict | MalformedRow]]:
    raw = path.read_bytes()
    try:
        text, invalid_utf8 = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        # undecodable bytes become lone surrogates, so the records holding them can be named one by one
        text, invalid_utf8 = raw.decode("utf-8", errors="surrogateescape"), True
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        yield 1, MalformedRow(path, 1, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})")
        return
    check = invalid_utf8 or _SURROGATE_ESCAPE.search(text)
    for row, record in enumerate(data if isinstance(data, list) else [data], start=1):
        if check and _has_lone_surrogate(record):
            yield row, MalformedRow(path, row, "not valid UTF-8" if invalid_utf8 else LONE_SURROGATE)
        else:
            yield row, _object_or_malformed(path, row, record)


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_lone_surrogate(v) for v in value)


def _object_or_malformed(path: Path, row: int, record) -> dict | MalformedRow:
    return record if isinstance(record, dict) else MalformedRow(
        path, row, f"expected a JSON object, got {type(record).__name__}")


def _parquet_records(path: Path) -> Iterator[tuple[int, dict | MalformedRow]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            try:
                records = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8: find the rows
                records = [_parquet_row(path, row + i + 1, batch.slice(i, 1)) for i in range(batch.num_rows)]
            for record in records:
                row += 1
                yield row, record
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable parquet file (truncated or corrupt?) after {row} rows: {e}") from None


def _parquet_row(path: Path, row: int, one_row) -> dict | MalformedRow:
    try:
        return one_row.to_pylist()[0]
    except UnicodeDecodeError:
        return MalformedRow(path, row, "not valid UTF-8")


def write_records(path: str | Path, records: list[dict]) -> None:
    """Write records as .jsonl (one JSON object per line) or .parquet, by the path's suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with path.open("w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = list(dict.fromkeys(k for record in records for k in record))  # every row's keys, not the first's
        pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in records] for k in columns}), path)
    else:
        raise ValueError(f"{path}: output files must be .jsonl or .parquet")
