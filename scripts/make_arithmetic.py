"""Generate the synthetic arithmetic dataset: seeded, disjoint ``{train,test,ood}.jsonl``.

Every knob of `selfcest.tasks.arithmetic.ArithmeticConfig` is an option (``--ops-min``,
``--digits-max``, ``--weight-mul``, ``--paren-prob``, ``--max-result-digits``, ...; defaults:
the paper's generator). An out-of-distribution split is drawn when ``--n-ood`` > 0, from the
same config with the ``--ood FIELD=VALUE`` overrides applied. Output: JSONL files of
`Task.to_dict()` rows; the same seed and options always give the same files.

    python scripts/make_arithmetic.py --out data/arithmetic --n-train 9000 --n-test 1000 \
        --n-ood 1000 --ood ops_min=11 --ood ops_max=14 --ood max_result_digits=24
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from selfcest.tasks.arithmetic import ArithmeticConfig, arithmetic_splits
from selfcest.tasks.io import report, write_splits


def _parse_overrides(pairs: list[str]) -> dict[str, float | int]:
    types = {f.name: type(getattr(ArithmeticConfig(), f.name)) for f in fields(ArithmeticConfig)}
    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--ood {pair!r}: expected FIELD=VALUE with FIELD in {sorted(types)}")
        overrides[name] = types[name](value)
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=9000)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--n-ood", type=int, default=0)
    parser.add_argument("--ood", action="append", default=[], metavar="FIELD=VALUE")
    defaults = ArithmeticConfig()
    for f in fields(ArithmeticConfig):
        default = getattr(defaults, f.name)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    config = ArithmeticConfig(**{f.name: getattr(args, f.name) for f in fields(ArithmeticConfig)})
    ood = replace(config, **_parse_overrides(args.ood)) if args.n_ood else None
    splits = arithmetic_splits(args.seed, config, ood, args.n_train, args.n_test, args.n_ood)
    counts = write_splits(vars(splits), args.out)
    print(report(counts, args.out, []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
