"""Prepare AIME for selfcest: one CSV in, ``train.jsonl`` and ``test.jsonl`` out.

Input: the AIME 1983-2024 collection as one CSV (usually ``AIME_Dataset_1983_2024.csv``)
with the columns ``ID, Year, Problem Number, Question, Answer`` and optionally ``Part``;
download it yourself (selfcest never downloads data). Output: JSONL files of
`Task.to_dict()` rows, split at random 90/10 with seed 42 as the paper's code did; read them
with ``selfcest.tasks.load_jsonl`` or ``load_tasks("jsonl", path=...)``.

    python scripts/prepare_aime.py --csv AIME_Dataset_1983_2024.csv --out data/aime

A malformed row stops the run with its row number, unless ``--skip-malformed`` is given
(then skipped rows are counted and the first ones printed).
"""

from __future__ import annotations

import argparse
import sys

from selfcest.tasks.io import report, write_splits
from selfcest.tasks.math import aime_splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", required=True, help="the AIME CSV file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-malformed", action="store_true")
    args = parser.parse_args(argv)
    skipped: list[str] | None = [] if args.skip_malformed else None
    splits = aime_splits(args.csv, args.test_fraction, args.seed, skipped)
    counts = write_splits(vars(splits), args.out)
    print(report(counts, args.out, skipped or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
