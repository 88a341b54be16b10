"""Math benchmarks from local files: AIME (CSV) and MATH-Hard (JSONL per category).

Neither can be downloaded by selfcest; users fetch them and point the loaders (or
``scripts/prepare_aime.py`` and ``scripts/prepare_math_hard.py``) at the files. `load_aime` and
`load_math_hard` give the formats.

Bad rows raise `MalformedRowError` naming the file and row, or are skipped and recorded when
the caller passes a ``skipped`` list (see `selfcest.tasks.io`).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from selfcest.task import Task
from selfcest.tasks.io import MalformedRowError, read_records, row_problem
from selfcest.tasks.splits import TaskSplits, random_split

AIME_SOURCE = "aime"
MATH_HARD_SOURCE = "math_hard"
AIME_COLUMNS = ("ID", "Year", "Problem Number", "Question", "Answer")

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``, or None.

    Braces are matched with a depth counter that skips escaped characters (``\\{``, ``\\}``),
    so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The unbraced form ``\\boxed 5`` gives
    what follows up to the next ``$`` or line end. Only the last box counts: if it is never
    closed (a truncated output), the answer is None rather than an earlier box.
    """
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    start = boxes[-1].end()
    rest = text[start:]
    stripped = rest.lstrip(" ")
    if not stripped.startswith("{"):
        content = re.split(r"[$\n]", stripped, maxsplit=1)[0].strip()
        return content or None
    depth = 0
    i = start + (len(rest) - len(stripped))
    open_at = i
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


# ---------------------------------------------------------------------------------- AIME


def load_aime(path: str | Path, skipped: list[str] | None = None) -> list[Task]:
    """Every problem of an AIME CSV as a task with id ``aime-{ID}``.

    AIME: one CSV with the columns ``ID, Year, Problem Number, Question, Answer`` and an
    optional ``Part`` (the 1983-2024 collection is distributed as
    ``AIME_Dataset_1983_2024.csv``). The answer is an integer. Split as the reference: a random
    90/10 train/test split with seed 42 (not by year).
    """
    path = Path(path)
    tasks: list[Task] = []
    ids: set[str] = set()
    with path.open(newline="", encoding="utf-8-sig") as file:
        reader = csv.DictReader(file)
        missing = [c for c in AIME_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise MalformedRowError(
                f"{path}: missing columns {missing} (found {reader.fieldnames})"
            )
        for n, row in enumerate(reader, 1):
            where = f"{path} row {n}"
            if None in row:  # csv puts surplus cells under the key None
                row_problem(where, "more cells than columns", skipped)
                continue
            aime_id = (row["ID"] or "").strip()
            question = (row["Question"] or "").strip()
            answer = (row["Answer"] or "").strip()
            if not aime_id or not question:
                row_problem(where, "empty ID or Question", skipped)
                continue
            if not re.fullmatch(r"-?\d+", answer):
                row_problem(where, f"answer {answer!r} is not an integer", skipped)
                continue
            if aime_id in ids:
                row_problem(where, f"duplicate ID {aime_id!r}", skipped)
                continue
            ids.add(aime_id)
            tasks.append(
                Task(
                    id=f"aime-{aime_id}",
                    prompt=question,
                    answer=str(int(answer)),  # "080" and "80" are the same answer
                    source=AIME_SOURCE,
                    metadata={
                        "year": (row["Year"] or "").strip(),
                        "problem_number": (row["Problem Number"] or "").strip(),
                        "part": (row.get("Part") or "").strip(),
                    },
                )
            )
    return tasks


def aime_splits(
    path: str | Path, test_fraction: float = 0.1, seed: int = 42, skipped: list[str] | None = None
) -> TaskSplits:
    """`load_aime` cut into train/test at random (the reference: 90/10, seed 42)."""
    train, test = random_split(load_aime(path, skipped), test_fraction, seed)
    return TaskSplits(train=train, test=test)


# ---------------------------------------------------------------------------------- MATH-Hard


def load_math_hard(
    root: str | Path, split: str, skipped: list[str] | None = None
) -> list[Task]:
    """Tasks of ``root/{split}/*.jsonl`` (files in name order).

    MATH-Hard: a folder with ``train/`` and ``test/`` sub-folders holding one file per category
    (``algebra.jsonl``, ...), each a JSON array or JSON lines of records with ``problem`` and
    ``solution`` (plus ``level`` and ``type``). The answer is the content of the last
    ``\\boxed{}`` or ``\\fbox{}`` of the solution (`last_boxed`). The native split is kept.

    Ids are ``math_hard-{split}-{category}-{n}`` with the file stem as category and n the
    record's 1-based position in its file.
    """
    folder = Path(root) / split
    files = sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl or *.json files in {folder}")
    tasks: list[Task] = []
    for file in files:
        category = file.stem
        for n, (where, record) in enumerate(read_records(file), 1):
            if isinstance(record, MalformedRowError):
                row_problem(where, str(record), skipped)
                continue
            if not isinstance(record, dict):
                row_problem(where, "expected a JSON object", skipped)
                continue
            problem = str(record.get("problem") or "").strip()
            solution = str(record.get("solution") or "")
            answer = last_boxed(solution)
            if not problem:
                row_problem(where, "empty or missing 'problem'", skipped)
                continue
            if not answer or not answer.strip():
                row_problem(where, "the solution has no (closed, non-empty) \\boxed{}", skipped)
                continue
            tasks.append(
                Task(
                    id=f"math_hard-{split}-{category}-{n}",
                    prompt=problem,
                    answer=answer.strip(),
                    source=MATH_HARD_SOURCE,
                    metadata={
                        "category": category,
                        "level": str(record.get("level", "")),
                        "type": str(record.get("type", "")),
                        "solution": solution,  # kept for analysis and SFT, never prompted
                    },
                )
            )
    return tasks


def math_hard_splits(root: str | Path, skipped: list[str] | None = None) -> TaskSplits:
    """The native train and test splits of a MATH-Hard folder."""
    return TaskSplits(
        train=load_math_hard(root, "train", skipped),
        test=load_math_hard(root, "test", skipped),
    )


def load_aime_split(
    path: str | Path, split: str = "train", test_fraction: float = 0.1, seed: int = 42
) -> list[Task]:
    """The ``split`` ("train" or "test") of `aime_splits` (the task source ``aime``)."""
    return aime_splits(path, test_fraction, seed)[split]
