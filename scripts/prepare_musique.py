"""Prepare MuSiQue for selfcest: split files in, ``{split}.jsonl`` out.

Input: MuSiQue-Ans v1.0 JSON lines, downloaded by you (``musique_ans_v1.0_train.jsonl``,
``musique_ans_v1.0_dev.jsonl``), records with ``id``, ``question``, ``answer``,
``answer_aliases``, ``answerable``, ``question_decomposition`` and ``paragraphs`` of
``{title, paragraph_text, is_supporting}``. The root prompt holds the question and the
paragraph titles only; the paragraphs go into the task's context map and the aliases into
its metadata (the QA reward accepts them). The dev split serves as validation. Output: JSONL
files of `Task.to_dict()` rows named after the split.

    python scripts/prepare_musique.py --train musique_ans_v1.0_train.jsonl \
        --dev musique_ans_v1.0_dev.jsonl --out data/musique

A malformed row stops the run naming its line, unless ``--skip-malformed`` is given.
"""

from __future__ import annotations

import argparse
import sys

from selfcest.tasks.io import report, write_splits
from selfcest.tasks.multihop import load_musique


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for split in ("train", "dev"):
        parser.add_argument(f"--{split}", help=f"the {split} split file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--skip-malformed", action="store_true")
    args = parser.parse_args(argv)
    files = {s: getattr(args, s) for s in ("train", "dev") if getattr(args, s)}
    if not files:
        parser.error("give --train and/or --dev")
    skipped: list[str] | None = [] if args.skip_malformed else None
    counts = write_splits({s: load_musique(f, skipped) for s, f in files.items()}, args.out)
    print(report(counts, args.out, skipped or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
