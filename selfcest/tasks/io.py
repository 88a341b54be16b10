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

import itertools
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


# Longer JSONL lines are refused unread (a 10 MB line is a broken file, not a task); the
# longest real rows, multi-hop contexts, are tens of KB. `load_jsonl` takes another limit.
MAX_LINE_BYTES = 4 << 20


def read_records(path: str | Path,
                 max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` for each record of a JSON array, JSONL or parquet file.

    ``where`` names the file and the 1-based row (the line for JSONL) for error messages.
    A JSONL line that is not valid UTF-8 or JSON, or longer than ``max_line_bytes``, is
    yielded as a `MalformedRowError` instance in place of the record, so the caller decides
    (through `row_problem`) whether to raise or skip.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only parquet inputs need pyarrow

        for n, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {n}", record
        return
    with path.open("rb") as stream:
        is_array = stream.read(1 << 16).lstrip().startswith(b"[")
    if is_array:
        yield from _json_array(path)
        return
    for n, line in _lines(path, max_line_bytes):
        where = f"{path} line {n}"
        if isinstance(line, MalformedRowError):
            yield where, line
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            yield where, MalformedRowError(f"not valid UTF-8 (byte {line[error.start]:#04x} at "
                                           f"column {error.start + 1})")
            continue
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as error:
            yield where, MalformedRowError(f"not valid JSON ({error.msg})")


def _lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | MalformedRowError]]:
    """The file's lines as bytes, numbered from 1; a line over ``limit`` bytes is skipped
    without being held in memory and yielded as a `MalformedRowError`."""
    with path.open("rb") as stream:
        for n in itertools.count(1):
            line = stream.readline(limit + 1)
            if not line:
                return
            if len(line) > limit and not line.endswith(b"\n"):
                size = len(line)
                while line and not line.endswith(b"\n"):
                    line = stream.readline(1 << 20)
                    size += len(line)
                yield n, MalformedRowError(f"a line of {size} bytes, over the {limit} a row may "
                                           "take (task.params.max_line_bytes)")
                continue
            yield n, line


def _json_array(path: Path) -> Iterator[tuple[str, Any]]:
    data = path.read_bytes()
    try:
        records = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise MalformedRowError(f"{path} line {line}: not valid UTF-8 (byte "
                                f"{data[error.start]:#04x})") from None
    except json.JSONDecodeError as error:
        raise MalformedRowError(f"{path}: not a valid JSON array ({error})") from None
    for n, record in enumerate(records, 1):
        yield f"{path} row {n}", record


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


def load_jsonl(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> list[Task]:
    """Read tasks written by `write_jsonl` (or any JSONL of `Task.to_dict()` rows).

    Raises `MalformedRowError` naming the file and line on a line that is not valid UTF-8
    or JSON, longer than ``max_line_bytes``, with a missing or unknown field, an empty
    answer or prompt, or a context that is not an object of texts; and naming the file
    when it holds no task.
    """
    tasks = []
    fields = {"id", "prompt", "answer", "context", "source", "metadata"}
    for where, record in read_records(path, max_line_bytes):
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
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise MalformedRowError(f"{where}: the prompt must be a non-empty string; got "
                                    f"{record['prompt']!r:.80}")
        context = record.get("context", {})
        if not isinstance(context, dict) or not all(isinstance(v, str) for v in context.values()):
            raise MalformedRowError(f"{where}: the context must be an object of texts; got "
                                    f"{context!r:.80}")
        tasks.append(Task.from_dict(record))
    if not tasks:
        raise MalformedRowError(f"{path}: no task in it (an empty file?)")
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
