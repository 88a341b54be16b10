"""Reading dataset files and writing/reading prepared task files.

Loaders read the files users download in several shapes (CSV, JSON arrays, JSONL, parquet)
through `read_records`, and report a bad row through `row_problem`: by default it raises a
`MalformedRowError` naming the file and the row; a caller that passes a ``skipped`` list gets
the row skipped and a ``"file row N: reason"`` line appended to that list instead (so the
count of skipped rows is ``len(skipped)``). A bad row never becomes a task with an empty
answer, which would silently score zero.

Prepared datasets are JSONL files of `Task.to_dict()` rows (`write_jsonl`, `load_jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from selfcest.task import Task


class MalformedRowError(ValueError):
    """A row of a dataset file that cannot become a task; the message names file and row."""


def row_problem(where: str, reason: str, skipped: list[str] | None) -> None:
    """Raise for a bad row, or record it in ``skipped`` when the caller collects skips."""
    message = f"{where}: {reason}"
    if skipped is None:
        raise MalformedRowError(message)
    skipped.append(message)


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` for each record of a JSON array, JSONL or parquet file.

    ``where`` names the file and the 1-based row (the line for JSONL) for error messages.
    A line that is not valid JSON is yielded as a `MalformedRowError` instance in place of
    the record, so the caller decides (through `row_problem`) whether to raise or skip.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only parquet inputs need pyarrow

        for n, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {n}", record
        return
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise MalformedRowError(f"{path}: not a valid JSON array ({error})") from None
        for n, record in enumerate(records, 1):
            yield f"{path} row {n}", record
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as error:
            yield where, MalformedRowError(f"not valid JSON ({error.msg})")


def write_jsonl(tasks: Iterable[Task], path: str | Path) -> int:
    """Write one `Task.to_dict()` per line; returns the number of tasks written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for task in tasks:
            out.write(json.dumps(task.to_dict(), ensure_ascii=False) + "\n")
            count += 1
    return count


def load_jsonl(path: str | Path) -> list[Task]:
    """Read tasks written by `write_jsonl` (or any JSONL of `Task.to_dict()` rows).

    Raises `MalformedRowError` naming the line on invalid JSON, a missing or unknown field,
    or an empty answer.
    """
    tasks = []
    fields = {"id", "prompt", "answer", "context", "source", "metadata"}
    for where, record in read_records(path):
        if isinstance(record, MalformedRowError):
            raise MalformedRowError(f"{where}: {record}")
        if not isinstance(record, dict):
            raise MalformedRowError(f"{where}: expected a JSON object")
        problems = []
        if missing := {"id", "prompt", "answer"} - record.keys():
            problems.append(f"missing fields {sorted(missing)}")
        if unknown := record.keys() - fields:
            problems.append(f"unknown fields {sorted(unknown)}")
        if problems:
            raise MalformedRowError(f"{where}: {', '.join(problems)}")
        if not str(record["answer"]).strip():
            raise MalformedRowError(f"{where}: empty answer")
        tasks.append(Task.from_dict(record))
    return tasks


def write_splits(splits: Mapping[str, Iterable[Task]], out_dir: str | Path) -> dict[str, int]:
    """Write each split to ``out_dir/{split}.jsonl``; returns the task count per split.

    Empty splits write no file (an OOD split a dataset does not have).
    """
    counts = {}
    for name, tasks in splits.items():
        tasks = list(tasks)
        if tasks:
            counts[name] = write_jsonl(tasks, Path(out_dir) / f"{name}.jsonl")
    return counts


def report(counts: Mapping[str, int], out_dir: str | Path, skipped: list[str]) -> str:
    """A human summary of a preparation run (what was written, what was skipped)."""
    out_dir = Path(out_dir)
    lines = [f"{name}: {n} tasks -> {out_dir / f'{name}.jsonl'}" for name, n in counts.items()]
    if skipped:
        lines.append(f"skipped {len(skipped)} malformed rows, first ones:")
        lines.extend(f"  {line}" for line in skipped[:5])
    return "\n".join(lines)
