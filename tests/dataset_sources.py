"""Small synthetic files in the published formats of the paper's datasets (docs/datasets.md),
named as the README's prepare commands read them. Every question's answer is ``answer`` (the
paper-run tests use "7", which their stand-in model sometimes writes).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

# The README's names of the downloaded files, relative to the folder the commands run in.
AIME_CSV = "AIME_Dataset_1983_2024.csv"
MATH_HARD_ROOT = "lighteval-MATH-Hard"
TWOWIKI_FILES = {"train": "2wiki/train.parquet", "dev": "2wiki/dev.parquet"}
MUSIQUE_FILES = {"train": "musique_ans_v1.0_train.jsonl", "dev": "musique_ans_v1.0_dev.jsonl"}


def write_aime(path: Path, n: int = 20, answer: str = "7") -> None:
    """The AIME collection's CSV: ID, Year, Problem Number, Question, Answer, Part (empty
    before 2000, "I" or "II" after)."""
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["ID", "Year", "Problem Number", "Question", "Answer", "Part"])
        for i in range(n):
            year, part, number = (1990 + i, "", 1) if i % 2 else (2000 + i, "II", 15)
            writer.writerow([f"{year}-{part}-{number}" if part else f"{year}-{number}", year,
                             number,
                             f"Find $x$ such that $x + {i} = {i} + 7$ (problem {i}).", answer,
                             part])


def write_math_hard(root: Path, n: int = 4, answer: str = "7") -> None:
    """lighteval MATH-Hard: train/ and test/, one file per category, JSON lines or a JSON
    array of {problem, level, type, solution}; the answer is the solution's last \\boxed{}."""
    for split in ("train", "test"):
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        rows = [{"problem": f"Compute $3 + {i} - {i} + 4$ ({split} {i}).", "level": "Level 5",
                 "type": "Algebra",
                 "solution": f"First $\\boxed{{3}}$ is wrong; adding gives $\\boxed{{{answer}}}$."}
                for i in range(n)]
        (folder / "algebra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        geometry = [{**r, "type": "Geometry", "problem": r["problem"] + " (a triangle)"}
                    for r in rows]
        (folder / "geometry.json").write_text(json.dumps(geometry))


def twowiki_record(i: int, answer: str = "7") -> dict:
    """One 2WikiMultihopQA record; context, supporting_facts and evidences decoded."""
    return {
        "_id": f"w{i}",
        "type": "compositional",
        "question": f"How many films did the director of Film {i} make?",
        "context": [[f"Film {i}", [f"Film {i} is directed by Person {i}.", "It is a drama."]],
                    [f"Person {i}", [f"Person {i} made {answer} films."]]],
        "supporting_facts": [[f"Film {i}", 0], [f"Person {i}", 0]],
        "evidences": [[f"Film {i}", "director", f"Person {i}"]],
        "answer": answer,
    }


def write_2wiki(path: Path, n: int = 8, answer: str = "7") -> None:
    """The parquet release: one row per record, its nested fields as JSON strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    nested = ("context", "supporting_facts", "evidences")
    rows = [{k: json.dumps(v) if k in nested else v for k, v in twowiki_record(i, answer).items()}
            for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def musique_record(i: int, answer: str = "7") -> dict:
    """One MuSiQue-Ans v1.0 record."""
    return {
        "id": f"2hop__{i}_{i + 100}",
        "paragraphs": [
            {"idx": 0, "title": f"Town {i}", "paragraph_text": f"Town {i} lies in County {i}.",
             "is_supporting": True},
            {"idx": 1, "title": f"County {i}", "paragraph_text": f"County {i} has {answer} lakes.",
             "is_supporting": True},
            {"idx": 2, "title": "Elsewhere", "paragraph_text": "Unrelated text.",
             "is_supporting": False},
        ],
        "question": f"How many lakes has the county of Town {i}?",
        "question_decomposition": [
            {"id": i, "question": f"Town {i} >> located in", "answer": f"County {i}",
             "paragraph_support_idx": 0},
            {"id": i + 100, "question": "#1 >> number of lakes", "answer": answer,
             "paragraph_support_idx": 1},
        ],
        "answer": answer,
        "answer_aliases": ["seven"],
        "answerable": True,
    }


def write_musique(path: Path, n: int = 8, answer: str = "7", start: int = 0) -> None:
    path.write_text("".join(json.dumps(musique_record(i, answer)) + "\n"
                            for i in range(start, start + n)))


def write_downloads(folder: Path, answer: str = "7") -> None:
    """Every file the README's prepare commands read, under the names they use."""
    write_aime(folder / AIME_CSV, answer=answer)
    write_math_hard(folder / MATH_HARD_ROOT, answer=answer)
    for relative in TWOWIKI_FILES.values():
        write_2wiki(folder / relative, answer=answer)
    for n, relative in enumerate(MUSIQUE_FILES.values()):
        write_musique(folder / relative, answer=answer, start=100 * n)
