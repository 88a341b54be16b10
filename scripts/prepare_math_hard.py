"""Prepare MATH-Hard for selfcest: a category-per-file folder in, ``{train,test}.jsonl`` out.

Input: a folder (e.g. ``lighteval-MATH-Hard``) with ``train/`` and ``test/`` sub-folders,
each holding one file per category (``algebra.jsonl``, ``geometry.jsonl``, ...) as JSON lines
or a JSON array of records with ``problem``, ``solution``, ``level`` and ``type``; download it
yourself. The reference answer is the content of the last ``\\boxed{}``/``\\fbox{}`` of the
solution; the native split is kept. Output: JSONL files of `Task.to_dict()` rows.

    python scripts/prepare_math_hard.py --root lighteval-MATH-Hard --out data/math_hard

A malformed row (no boxed answer, broken JSON) stops the run naming its file and line,
unless ``--skip-malformed`` is given.
"""

from __future__ import annotations

import argparse
import sys

from selfcest.tasks.io import report, write_splits
from selfcest.tasks.math import math_hard_splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="folder with train/ and test/")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--skip-malformed", action="store_true")
    args = parser.parse_args(argv)
    skipped: list[str] | None = [] if args.skip_malformed else None
    counts = write_splits(vars(math_hard_splits(args.root, skipped)), args.out)
    print(report(counts, args.out, skipped or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
