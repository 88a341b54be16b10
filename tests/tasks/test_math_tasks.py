import csv
import json

import pytest

from selfcest.tasks.io import MalformedRowError
from selfcest.tasks.math import (
    aime_splits,
    last_boxed,
    load_aime,
    load_math_hard,
    math_hard_splits,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{1} then \fbox{2}", "2"),
        (r"\fbox{a} then \boxed{b}", "b"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),
        (r"$\boxed 5$ done", "5"),
        (r"\boxed {7}", "7"),
        (r"\boxed{3} and finally \boxed{4", None),  # the last box is not closed
        (r"no box at all", None),
        (r"\boxedfoo{3}", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


COLUMNS = ("ID", "Year", "Problem Number", "Question", "Answer", "Part")


def write_aime(path, rows, columns=COLUMNS):
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)


def aime_rows(n):
    return [[f"2020-I-{i}", "2020", str(i), f"Find x.\nLine two of {i}.", f"0{i:02d}", "I"]
            for i in range(1, n + 1)]


def test_aime_csv(tmp_path):
    path = tmp_path / "AIME_Dataset_1983_2024.csv"
    write_aime(path, aime_rows(3))
    tasks = load_aime(path)
    assert [t.id for t in tasks] == ["aime-2020-I-1", "aime-2020-I-2", "aime-2020-I-3"]
    assert tasks[0].prompt == "Find x.\nLine two of 1."  # a quoted multi-line cell
    assert tasks[0].answer == "1"  # "001" normalised
    assert tasks[1].metadata == {"year": "2020", "problem_number": "2", "part": "I"}
    assert tasks[0].source == "aime" and tasks[0].context == {}


def test_aime_without_part_column(tmp_path):
    path = tmp_path / "aime.csv"
    write_aime(path, [r[:5] for r in aime_rows(2)], COLUMNS[:5])
    assert load_aime(path)[1].metadata["part"] == ""


def test_aime_missing_column(tmp_path):
    path = tmp_path / "aime.csv"
    write_aime(path, [["1", "2020", "1", "q"]], ("ID", "Year", "Problem Number", "Question"))
    with pytest.raises(MalformedRowError, match=r"aime.csv: missing columns \['Answer'\]"):
        load_aime(path)


def test_aime_malformed_rows_raise_or_are_counted(tmp_path):
    path = tmp_path / "aime.csv"
    rows = aime_rows(4)
    rows[1][4] = "seventeen"
    rows[3][3] = ""
    write_aime(path, rows)
    with pytest.raises(MalformedRowError, match=r"aime.csv row 2: answer 'seventeen'"):
        load_aime(path)
    skipped = []
    tasks = load_aime(path, skipped)
    assert [t.id for t in tasks] == ["aime-2020-I-1", "aime-2020-I-3"]
    assert len(skipped) == 2 and "row 4: empty ID or Question" in skipped[1]


def test_aime_duplicate_id(tmp_path):
    path = tmp_path / "aime.csv"
    write_aime(path, aime_rows(2) + aime_rows(1))
    with pytest.raises(MalformedRowError, match="row 3: duplicate ID"):
        load_aime(path)


def test_aime_split_is_seeded_90_10(tmp_path):
    path = tmp_path / "aime.csv"
    write_aime(path, aime_rows(40))
    splits = aime_splits(path)
    train, test = {t.id for t in splits.train}, {t.id for t in splits.test}
    assert len(train) == 36 and len(test) == 4 and not train & test
    assert aime_splits(path).test == splits.test
    assert {t.id for t in aime_splits(path, seed=7).test} != test


def write_math_hard(root):
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    level = {"level": "Level 5", "type": "Algebra"}
    algebra = [
        {"problem": "Solve 2x = 1.", "solution": r"So $x = \boxed{\frac{1}{2}}$.", **level},
        {"problem": "What is 3+4?", "solution": r"First \boxed{6}, no: \fbox{7}", **level},
    ]
    (root / "train" / "algebra.jsonl").write_text("\n".join(json.dumps(r) for r in algebra) + "\n")
    geometry = [{"problem": "Area?", "solution": r"It is $\boxed{4\pi}$", "type": "Geometry"}]
    (root / "train" / "geometry.jsonl").write_text(json.dumps(geometry))  # a JSON array file
    (root / "test" / "algebra.jsonl").write_text(
        json.dumps({"problem": "1+1?", "solution": r"\boxed{2}", **level})
    )


def test_math_hard_folder(tmp_path):
    write_math_hard(tmp_path)
    splits = math_hard_splits(tmp_path)
    assert [t.answer for t in splits.train] == [r"\frac{1}{2}", "7", r"4\pi"]
    assert [t.id for t in splits.train] == [
        "math_hard-train-algebra-1", "math_hard-train-algebra-2", "math_hard-train-geometry-1"
    ]
    assert splits.train[2].metadata["category"] == "geometry"
    assert splits.train[0].metadata["solution"].startswith("So $x")
    assert splits.train[0].prompt == "Solve 2x = 1."
    assert [t.answer for t in splits.test] == ["2"]


def test_math_hard_malformed_rows(tmp_path):
    write_math_hard(tmp_path)
    with (tmp_path / "train" / "algebra.jsonl").open("a") as f:
        f.write(json.dumps({"problem": "No box", "solution": "It is 5."}) + "\n")
        f.write("{not json\n")
    with pytest.raises(MalformedRowError, match=r"algebra.jsonl line 3: the solution has no"):
        load_math_hard(tmp_path, "train")
    skipped = []
    tasks = load_math_hard(tmp_path, "train", skipped)
    assert len(tasks) == 3 and len(skipped) == 2
    assert "line 4: not valid JSON" in skipped[1]


def test_math_hard_missing_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl"):
        load_math_hard(tmp_path, "train")
