"""The data-preparation scripts, run in process on small fixtures of each real format."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from selfcest.tasks import load_jsonl
from selfcest.tasks.io import MalformedRowError

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def script(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


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
