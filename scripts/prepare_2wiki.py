"""Prepare 2WikiMultihopQA for selfcest: split files in, ``{split}.jsonl`` out.

Input: one file per split, downloaded by you: parquet (the release whose ``context``,
``supporting_facts`` and ``evidences`` columns are JSON strings), JSON lines, or the original
JSON arrays (``train.json``, ``dev.json``). Each record has ``_id``, ``question``,
``answer``, ``type`` and ``context`` entries ``[title, [sentences]]``. The root prompt holds
the question and the paragraph titles only; the paragraphs go into the task's context map.
Output: JSONL files of `Task.to_dict()` rows named after the split.

    python scripts/prepare_2wiki.py --train train.parquet --dev dev.parquet --out data/2wiki

The test split has no answers, so every test row is malformed: leave it out, or pass
``--skip-malformed`` to skip and count rows without answers.
"""

from __future__ import annotations

import argparse
import sys

from selfcest.tasks.io import report, write_splits
from selfcest.tasks.multihop import load_2wiki


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for split in ("train", "dev", "test"):
        parser.add_argument(f"--{split}", help=f"the {split} split file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--skip-malformed", action="store_true")
    args = parser.parse_args(argv)
    files = {s: getattr(args, s) for s in ("train", "dev", "test") if getattr(args, s)}
    if not files:
        parser.error("give at least one of --train, --dev, --test")
    skipped: list[str] | None = [] if args.skip_malformed else None
    counts = write_splits({s: load_2wiki(f, skipped) for s, f in files.items()}, args.out)
    print(report(counts, args.out, skipped or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
