"""Long-context multi-hop QA from local files: 2WikiMultihopQA and MuSiQue.

As in the paper, the root sees the question and the paragraph titles (the context keys)
only::

    Question:
    Who is the mother of the director of film Polish-Russian War?
    Context keys:
    - Xawery Żuławski
    - Polish-Russian War (film)

and the paragraphs live in `Task.context` (title -> text), reaching a clone only when its
parent hands it a key. `load_2wiki` and `load_musique` read one split file each, which the
user downloads (the formats: their docstrings).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from selfcest.task import Task
from selfcest.tasks.io import MalformedRowError, read_records, row_problem

TWOWIKI_SOURCE = "2wiki"
MUSIQUE_SOURCE = "musique"


class _BadRow(Exception):
    """Raised inside a row parser; the loader turns it into `row_problem`."""


def multihop_prompt(question: str, keys: Iterable[str]) -> str:
    """The root prompt: the question and the context keys, nothing else."""
    lines = ["Question:", question, "Context keys:"]
    lines.extend(f"- {key}" for key in keys)
    return "\n".join(lines)


def _merge(paragraphs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """title -> text, concatenating texts of repeated titles (insertion order kept).

    Paragraphs sharing a title are concatenated (in file order) under that title, so no text is lost
    and every key is unique.
    """
    context: dict[str, str] = {}
    for title, text in paragraphs:
        context[title] = f"{context[title]} {text}" if title in context else text
    return context


def _title(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"invalid paragraph title {value!r}")
    return " ".join(value.split())  # a key is one line of the prompt


def _decoded(record: dict, name: str) -> Any:
    value = record.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise _BadRow(f"field {name!r} is not valid JSON ({error.msg})") from None
    return value


def _text(record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"missing or empty {name!r}")
    return value.strip()


def _load(path: str | Path, parse, skipped: list[str] | None) -> list[Task]:
    tasks: list[Task] = []
    ids: set[str] = set()
    for where, record in read_records(path):
        try:
            if isinstance(record, MalformedRowError):
                raise _BadRow(str(record))
            if not isinstance(record, dict):
                raise _BadRow("expected a JSON object")
            task = parse(record)
            if task.id in ids:
                raise _BadRow(f"duplicate id {task.id!r}")
        except _BadRow as problem:
            row_problem(where, str(problem), skipped)
            continue
        ids.add(task.id)
        tasks.append(task)
    return tasks


# ---------------------------------------------------------------------------------- 2Wiki


def _parse_2wiki(record: dict) -> Task:
    row_id = record.get("_id", record.get("id"))
    if row_id in (None, ""):
        raise _BadRow("missing '_id'")
    question = _text(record, "question")
    answer = _text(record, "answer")
    entries = _decoded(record, "context")
    if not isinstance(entries, list) or not entries:
        raise _BadRow("'context' must be a non-empty list of [title, [sentences]]")
    paragraphs = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise _BadRow(f"context entry {str(entry)[:60]!r} is not [title, [sentences]]")
        title, sentences = entry
        if not isinstance(sentences, (list, tuple)) or not all(
            isinstance(s, str) for s in sentences
        ):
            raise _BadRow(f"sentences of {title!r} are not a list of strings")
        paragraphs.append((_title(title), " ".join(s.strip() for s in sentences if s.strip())))
    context = _merge(paragraphs)
    return Task(
        id=f"2wiki-{row_id}",
        prompt=multihop_prompt(question, context),
        answer=answer,
        context=context,
        source=TWOWIKI_SOURCE,
        metadata={
            "aliases": [],
            "type": str(record.get("type") or ""),
            "supporting_facts": _decoded(record, "supporting_facts") or [],
            "evidences": _decoded(record, "evidences") or [],
        },
    )


def load_2wiki(path: str | Path, skipped: list[str] | None = None) -> list[Task]:
    """One 2WikiMultihopQA split file (parquet, JSONL or JSON array) as tasks ``2wiki-{_id}``.

    Format: parquet, JSONL or a JSON array of records with ``_id`` (or ``id``),
    ``question``, ``answer``, ``type``, ``context``, ``supporting_facts`` and ``evidences``.
    ``context``, ``supporting_facts`` and ``evidences`` may be JSON strings (the parquet release) or
    already decoded; each context entry is ``[title, [sentence, ...]]`` and the sentences are joined
    with spaces. Its test split has no answers: those rows are malformed.

    Answer aliases go to ``metadata["aliases"]`` (a list, empty for 2Wiki), where the QA reward
    finds them.

    Bad rows raise `MalformedRowError` naming the file and row, or are skipped and recorded when the
    caller passes a ``skipped`` list (see `selfcest.tasks.io`).
    """
    return _load(path, _parse_2wiki, skipped)


# ---------------------------------------------------------------------------------- MuSiQue


def _parse_musique(record: dict) -> Task:
    row_id = record.get("id")
    if row_id in (None, ""):
        raise _BadRow("missing 'id'")
    question = _text(record, "question")
    answer = _text(record, "answer")
    aliases = record.get("answer_aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise _BadRow("'answer_aliases' must be a list of strings")
    raw = record.get("paragraphs")
    if not isinstance(raw, list) or not raw:
        raise _BadRow("'paragraphs' must be a non-empty list")
    paragraphs, supporting = [], []
    for paragraph in raw:
        if not isinstance(paragraph, dict) or not isinstance(paragraph.get("paragraph_text"), str):
            raise _BadRow(f"paragraph {str(paragraph)[:60]!r} lacks title/paragraph_text")
        title = _title(paragraph.get("title"))
        paragraphs.append((title, paragraph["paragraph_text"].strip()))
        if paragraph.get("is_supporting") and title not in supporting:
            supporting.append(title)
    context = _merge(paragraphs)
    return Task(
        id=f"musique-{row_id}",
        prompt=multihop_prompt(question, context),
        answer=answer,
        context=context,
        source=MUSIQUE_SOURCE,
        metadata={
            "aliases": [a.strip() for a in aliases if a.strip()],
            "answerable": bool(record.get("answerable", True)),
            "question_decomposition": record.get("question_decomposition") or [],
            "supporting_titles": supporting,
        },
    )


def load_musique(path: str | Path, skipped: list[str] | None = None) -> list[Task]:
    """One MuSiQue split file (JSONL) as tasks ``musique-{id}``.

    Format: MuSiQue (``musique_ans_v1.0_{train,dev}.jsonl``): JSONL records with ``id``,
    ``question``, ``answer``, ``answer_aliases`` and ``paragraphs`` of ``{title, paragraph_text,
    is_supporting}``, plus ``answerable`` and ``question_decomposition``.

    Answer aliases go to ``metadata["aliases"]`` (a list, empty for 2Wiki), where the QA reward
    finds them.

    Bad rows raise `MalformedRowError` naming the file and row, or are skipped and recorded when the
    caller passes a ``skipped`` list (see `selfcest.tasks.io`).
    """
    return _load(path, _parse_musique, skipped)
