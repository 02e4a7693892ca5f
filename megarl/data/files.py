"""Reading and writing record files (.jsonl, .parquet, .json) row by row, with errors that name file and row.

Rows are numbered from 1 (for .jsonl, the line number; blank lines are skipped but keep their numbers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

SUFFIXES = (".jsonl", ".parquet", ".json")


class MalformedRow(ValueError):
    """A row that cannot be used; the message names the file and the row."""

    def __init__(self, path: Path | str, row: int, problem: str):
        super().__init__(f"{path}, row {row}: {problem}")
        self.path, self.row, self.problem = str(path), row, problem


def iter_records(path: str | Path) -> Iterator[tuple[int, dict | MalformedRow]]:
    """(row number, record) for each row; a row that is not a JSON object comes as a MalformedRow instead,
    so a caller can stop on it or skip it. A .json file holds one object or a list of them."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: record files must be {', '.join(SUFFIXES)}")
    if not path.exists():
        raise FileNotFoundError(f"record file not found: {path}")
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            yield 1, MalformedRow(path, 1, f"not valid JSON ({e.msg})")
            return
        for row, record in enumerate(data if isinstance(data, list) else [data], start=1):
            yield row, record if isinstance(record, dict) else MalformedRow(
                path, row, f"expected a JSON object, got {type(record).__name__}")
        return
    with path.open() as f:
        for row, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield row, MalformedRow(path, row, f"not valid JSON ({e.msg})")
                continue
            yield row, record if isinstance(record, dict) else MalformedRow(
                path, row, f"expected a JSON object, got {type(record).__name__}")


def _parquet_records(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield row, record


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
