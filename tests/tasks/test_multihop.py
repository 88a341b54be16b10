import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from selfcest.tasks.io import MalformedRowError
from selfcest.tasks.multihop import load_2wiki, load_musique

CONTEXT = [
    [
        "Polish-Russian War (film)",
        ["Polish-Russian War is a 2009 film.", "It was directed by Xawery Żuławski."],
    ],
    ["Xawery Żuławski", ["Xawery Żuławski is a director."]],
    ["Polish-Russian War (film)", ["Its score was written by a band."]],
]


def wiki_row(row_id="a1", **overrides):
    """A 2Wiki record as in the parquet release: structured fields are JSON strings."""
    row = {
        "_id": row_id,
        "type": "compositional",
        "question": "Who is the mother of the director of film Polish-Russian War?",
        "answer": "Małgorzata Braunek",
        "context": json.dumps(CONTEXT, ensure_ascii=False),
        "supporting_facts": json.dumps([["Polish-Russian War (film)", 1]]),
        "evidences": json.dumps([["Polish-Russian War", "director", "Xawery Żuławski"]]),
    }
    row.update(overrides)
    return row


def write_jsonl(path, rows):
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows]
    path.write_text("".join(lines), encoding="utf-8")


def check_wiki_task(task):
    assert task.id == "2wiki-a1"
    assert task.prompt == (
        "Question:\nWho is the mother of the director of film Polish-Russian War?\n"
        "Context keys:\n- Polish-Russian War (film)\n- Xawery Żuławski"
    )
    assert task.context == {
        "Polish-Russian War (film)": "Polish-Russian War is a 2009 film. It was directed by "
        "Xawery Żuławski. Its score was written by a band.",
        "Xawery Żuławski": "Xawery Żuławski is a director.",
    }
    assert "2009" not in task.prompt  # paragraphs never reach the root prompt
    assert task.answer == "Małgorzata Braunek"
    assert task.metadata["aliases"] == []
    assert task.metadata["supporting_facts"] == [["Polish-Russian War (film)", 1]]
    assert task.metadata["type"] == "compositional"
    assert task.source == "2wiki"


def test_2wiki_jsonl_with_json_string_fields(tmp_path):
    path = tmp_path / "dev.jsonl"
    write_jsonl(path, [wiki_row()])
    check_wiki_task(load_2wiki(path)[0])


def test_2wiki_parquet(tmp_path):
    path = tmp_path / "dev.parquet"
    pq.write_table(pa.Table.from_pylist([wiki_row(), wiki_row("a2")]), path)
    tasks = load_2wiki(path)
    check_wiki_task(tasks[0])
    assert tasks[1].id == "2wiki-a2"


def test_2wiki_json_array_with_decoded_fields(tmp_path):
    path = tmp_path / "dev.json"
    row = wiki_row(context=CONTEXT, supporting_facts=[["Polish-Russian War (film)", 1]])
    path.write_text(json.dumps([row], ensure_ascii=False), encoding="utf-8")
    check_wiki_task(load_2wiki(path)[0])


def test_2wiki_malformed_rows(tmp_path):
    path = tmp_path / "test.jsonl"
    write_jsonl(path, [wiki_row(), wiki_row("a2", answer=""), wiki_row("a3", context="[[broken"),
                       wiki_row("a4", context=json.dumps([["title only"]])), wiki_row("a1")])
    with pytest.raises(MalformedRowError, match=r"test.jsonl line 2: missing or empty 'answer'"):
        load_2wiki(path)
    skipped = []
    assert [t.id for t in load_2wiki(path, skipped)] == ["2wiki-a1"]
    assert len(skipped) == 4
    assert "line 3: field 'context' is not valid JSON" in skipped[1]
    assert "line 4: context entry" in skipped[2]
    assert "line 5: duplicate id '2wiki-a1'" in skipped[3]


def paragraph(idx, title, text, supporting):
    return {"idx": idx, "title": title, "paragraph_text": text, "is_supporting": supporting}


def musique_row(row_id="2hop__1", **overrides):
    row = {
        "id": row_id,
        "question": "When was the institute that owns The Collegian founded?",
        "answer": "1960",
        "answer_aliases": ["in 1960", "nineteen sixty"],
        "answerable": True,
        "question_decomposition": [{"id": 1, "question": "Who owns The Collegian?"}],
        "paragraphs": [
            paragraph(0, "The Collegian", "Owned by Houston Baptist.", True),
            paragraph(1, "Houston Baptist University", "Founded in 1960.", True),
            paragraph(2, "The Collegian", "A weekly paper.", False),
            paragraph(3, "Rice  University", "Founded 1912.", False),
        ],
    }
    row.update(overrides)
    return row


def test_musique(tmp_path):
    path = tmp_path / "musique_ans_v1.0_dev.jsonl"
    write_jsonl(path, [musique_row()])
    task = load_musique(path)[0]
    assert task.id == "musique-2hop__1"
    assert task.prompt == (
        "Question:\nWhen was the institute that owns The Collegian founded?\nContext keys:\n"
        "- The Collegian\n- Houston Baptist University\n- Rice University"
    )
    assert task.context["The Collegian"] == "Owned by Houston Baptist. A weekly paper."
    assert task.context["Rice University"] == "Founded 1912."
    assert task.metadata["aliases"] == ["in 1960", "nineteen sixty"]
    assert task.metadata["supporting_titles"] == ["The Collegian", "Houston Baptist University"]
    assert task.metadata["answerable"] is True
    assert task.source == "musique"


def test_musique_malformed_rows(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [musique_row(answer_aliases="1960"), musique_row("x", paragraphs=[]),
                       musique_row("y")])
    with pytest.raises(MalformedRowError, match="line 1: 'answer_aliases' must be a list"):
        load_musique(path)
    skipped = []
    assert [t.id for t in load_musique(path, skipped)] == ["musique-y"]
    assert "line 2: 'paragraphs' must be a non-empty list" in skipped[1]
