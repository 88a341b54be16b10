"""The data-preparation scripts, run in process on small fixtures of each real format."""

import csv
import json

import pytest
from dataset_sources import (
    musique_record,
    twowiki_record,
    write_2wiki,
    write_aime,
    write_math_hard,
    write_musique,
)
from helpers import script_main as script

from selfcest.tasks import load_jsonl
from selfcest.tasks.io import MalformedRowError


def test_prepare_aime(tmp_path, capsys):
    source = tmp_path / "AIME_Dataset_1983_2024.csv"
    with source.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ID", "Year", "Problem Number", "Question", "Answer", "Part"])
        writer.writerows([[f"1990-{i}", "1990", str(i), f"Q{i}?", str(i), ""] for i in range(20)])
    assert script("prepare_aime")(["--csv", str(source), "--out", str(tmp_path / "out")]) == 0
    train, test = load_jsonl(tmp_path / "out/train.jsonl"), load_jsonl(tmp_path / "out/test.jsonl")
    assert len(train) == 18 and len(test) == 2
    assert "train: 18 tasks" in capsys.readouterr().out


def test_prepare_math_hard_skips_and_reports(tmp_path, capsys):
    for split in ("train", "test"):
        (tmp_path / "src" / split).mkdir(parents=True)
        rows = [{"problem": "p", "solution": r"\boxed{3}"}, {"problem": "q", "solution": "none"}]
        (tmp_path / "src" / split / "algebra.jsonl").write_text("\n".join(map(json.dumps, rows)))
    args = ["--root", str(tmp_path / "src"), "--out", str(tmp_path / "out")]
    with pytest.raises(MalformedRowError, match="algebra.jsonl line 2"):
        script("prepare_math_hard")(args)
    assert script("prepare_math_hard")(args + ["--skip-malformed"]) == 0
    assert [t.answer for t in load_jsonl(tmp_path / "out/test.jsonl")] == ["3"]
    assert "skipped 2 malformed rows" in capsys.readouterr().out


def test_prepare_2wiki_and_musique(tmp_path):
    wiki = {"_id": "w1", "question": "q?", "answer": "a", "type": "comparison",
            "context": json.dumps([["T1", ["s1.", "s2."]], ["T2", ["s3."]]]),
            "supporting_facts": "[]", "evidences": "[]"}
    (tmp_path / "dev.jsonl").write_text(json.dumps(wiki) + "\n")
    out = tmp_path / "wiki"
    assert script("prepare_2wiki")(["--dev", str(tmp_path / "dev.jsonl"), "--out", str(out)]) == 0
    assert load_jsonl(out / "dev.jsonl")[0].context == {"T1": "s1. s2.", "T2": "s3."}
    assert not (out / "train.jsonl").exists()

    musique = {"id": "m1", "question": "q?", "answer": "a", "answer_aliases": ["b"],
               "paragraphs": [{"title": "T", "paragraph_text": "x", "is_supporting": True}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(musique) + "\n")
    out = tmp_path / "musique"
    assert script("prepare_musique")(["--train", str(tmp_path / "m.jsonl"), "--out", str(out)]) == 0
    assert load_jsonl(out / "train.jsonl")[0].metadata["aliases"] == ["b"]


def test_make_arithmetic_is_seeded_and_takes_every_knob(tmp_path):
    args = ["--n-train", "30", "--n-test", "5", "--n-ood", "5", "--ops-min", "2", "--ops-max", "2",
            "--digits-max", "3", "--ood", "ops_min=5", "--ood", "ops_max=5"]
    make = script("make_arithmetic")
    assert make(args + ["--out", str(tmp_path / "a")]) == 0
    assert make(args + ["--out", str(tmp_path / "b")]) == 0
    for split in ("train", "test", "ood"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_text() == (
            tmp_path / "b" / f"{split}.jsonl"
        ).read_text()
    assert {t.metadata["num_ops"] for t in load_jsonl(tmp_path / "a/train.jsonl")} == {2}
    assert {t.metadata["num_ops"] for t in load_jsonl(tmp_path / "a/ood.jsonl")} == {5}
    with pytest.raises(SystemExit):
        make(["--out", str(tmp_path / "c"), "--n-ood", "1", "--ood", "nope=1"])


# ------------------------------------------------ the published formats (docs/datasets.md)


def test_prepare_aime_reads_the_collections_columns(tmp_path):
    write_aime(tmp_path / "aime.csv", n=10, answer="080")
    assert script("prepare_aime")(["--csv", str(tmp_path / "aime.csv"), "--out",
                                   str(tmp_path)]) == 0
    tasks = load_jsonl(tmp_path / "train.jsonl") + load_jsonl(tmp_path / "test.jsonl")
    assert len(tasks) == 10 and {t.answer for t in tasks} == {"80"}
    assert {t.metadata["part"] for t in tasks} == {"", "II"}
    assert all(t.id.startswith("aime-") and t.source == "aime" for t in tasks)


def test_prepare_math_hard_answers_with_the_last_box_of_every_category(tmp_path):
    write_math_hard(tmp_path / "src", n=3, answer=r"\frac{7}{2}")
    assert script("prepare_math_hard")(["--root", str(tmp_path / "src"), "--out",
                                        str(tmp_path)]) == 0
    for split in ("train", "test"):
        tasks = load_jsonl(tmp_path / f"{split}.jsonl")
        # JSONL, JSON array
        assert {t.metadata["category"] for t in tasks} == {"algebra", "geometry"}
        assert {t.answer for t in tasks} == {r"\frac{7}{2}"}  # not the earlier \boxed{3}
        assert all("boxed" not in t.prompt and t.source == "math_hard" for t in tasks)


def test_prepare_2wiki_decodes_the_parquet_releases_json_strings(tmp_path):
    write_2wiki(tmp_path / "train.parquet", n=3)
    assert script("prepare_2wiki")(["--train", str(tmp_path / "train.parquet"), "--out",
                                    str(tmp_path)]) == 0
    task = load_jsonl(tmp_path / "train.jsonl")[0]
    record = twowiki_record(0)
    assert task.context == {"Film 0": "Film 0 is directed by Person 0. It is a drama.",
                            "Person 0": "Person 0 made 7 films."}
    assert "Film 0 is directed" not in task.prompt and "- Person 0" in task.prompt  # keys only
    assert task.metadata["supporting_facts"] == record["supporting_facts"]
    assert task.metadata[
        "evidences"] == record["evidences"] and task.metadata["type"] == "compositional"


def test_prepare_musique_keeps_aliases_support_and_decomposition(tmp_path):
    write_musique(tmp_path / "dev.jsonl", n=2)
    assert script("prepare_musique")(["--dev", str(tmp_path / "dev.jsonl"), "--out",
                                      str(tmp_path)]) == 0
    task = load_jsonl(tmp_path / "dev.jsonl")[0]
    assert task.answer == "7" and task.metadata["aliases"] == ["seven"]
    assert task.metadata["supporting_titles"] == ["Town 0", "County 0"]
    assert task.metadata["question_decomposition"] == musique_record(0)["question_decomposition"]
    assert list(task.context) == ["Town 0", "County 0", "Elsewhere"] and task.metadata["answerable"]
