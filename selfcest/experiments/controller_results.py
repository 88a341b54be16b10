"""The controller sweep's tables, read from its records (``docs/results/controller_sweep.json``).

::

    python -m selfcest.experiments.controller_results [path/to/controller_sweep.json]

prints the README's table and the tables of docs/controller.md. Each figure over seeds is
the mean of the seeds' figures; an interval over seeds is the envelope of the seeds' own 95%
intervals (lowest low, highest high), so it holds the run-to-run spread as well as each
run's sampling noise.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from selfcest.experiments.controller import POLICIES

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "controller_sweep.json"
SHORT = {"direct": "D", "delegate": "G", "tie": "="}


def load(path: Path = RESULTS) -> list[dict]:
    return json.loads(Path(path).read_text())


def by_setting(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Records grouped by (setting, credit), in the order they first appear; seeds sorted."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[record["name"], record["credit"]].append(record)
    return {key: sorted(runs, key=lambda r: r["seed"]) for key, runs in groups.items()}


def both_open(record: dict) -> list[int]:
    """Indices of the sizes where the warm start's forced direct is right at least half the
    time (both styles fit the context there)."""
    return [i for i, acc in enumerate(record["forced"]["warm start"]["direct"]) if acc >= 0.5]


def only_delegation(record: dict) -> list[int]:
    """Indices of the other sizes: only delegation fits the context there."""
    return [i for i in range(len(record["sizes"])) if i not in both_open(record)]


def mean_at(runs: list[dict], field, indices_of) -> float:
    return statistics.fmean(statistics.fmean(field(r)[i] for i in indices_of(r)) for r in runs)


def envelope(runs: list[dict], key: str) -> tuple[float, float, float]:
    """(lowest low, mean of the seeds' means, highest high) of the seeds' intervals."""
    return (
        min(r[key][0] for r in runs),
        statistics.fmean(r[key][1] for r in runs),
        max(r[key][2] for r in runs),
    )


def passes(runs: list[dict], key: str, bound: float) -> int:
    """How many seeds' intervals lie wholly above ``bound``."""
    return sum(r[key][0] > bound for r in runs)


def follows_oracle(record: dict) -> tuple[int, int]:
    """(sizes where the RL policy's P(delegate) is on the oracle's side: >= 0.8 where
    delegating is better, <= 0.2 where direct is, sizes with an oracle that is not a tie)."""
    pairs = [(p, o) for p, o in zip(record["p_delegate"]["RL"], record["oracle_rl"]) if o != "tie"]
    return sum((p >= 0.8) if o == "delegate" else (p <= 0.2) for p, o in pairs), len(pairs)


def fmt(interval: tuple[float, float, float]) -> str:
    low, mean, high = interval
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def cost_label(record: dict) -> str:
    if record["cost"] == "none":
        return "none"
    unit = "processed" if record["cost"] == "token" else "critical-path"
    return f"{record['lambda']:g} × {unit} tokens"


def readme_table(records: list[dict]) -> str:
    """Broadcast credit, one row per cost: the decision before and after RL, and RL's gains."""
    rows = []
    for (name, credit), runs in by_setting(records).items():
        if credit != "broadcast":
            continue
        small = [mean_at(runs, lambda r, p=p: r["p_delegate"][p], both_open) for p in POLICIES]
        large = mean_at(runs, lambda r: r["p_delegate"]["RL"], only_delegation)
        followed = [follows_oracle(r) for r in runs]
        rows.append(
            [
                cost_label(runs[0]),
                f"{small[0]:.2f} → {small[1]:.2f}",
                f"{large:.2f}",
                ", ".join(str(r["boundary"]["RL"]) for r in runs),
                f"{sum(f for f, _ in followed)}/{sum(n for _, n in followed)}",
                fmt(envelope(runs, "rl_minus_warm_start")),
                f"{passes(runs, 'rl_minus_warm_start', 0)}/{len(runs)}",
                fmt(envelope(runs, "rl_minus_best_forced")),
            ]
        )
    return table(
        [
            "cost",
            "P(delegate) where both fit: start → RL",
            "P(delegate) where only delegation fits",
            "boundary per seed",
            "on the oracle's side",
            "RL − warm start",
            "seeds gaining",
            "RL − best forced style",
        ],
        rows,
    )


def credit_table(records: list[dict], setting: str = "controller") -> str:
    """The credit strategies on one setting: reward, gains, decision accuracy, skills kept."""
    rows = []
    for (name, credit), runs in by_setting(records).items():
        if name != setting:
            continue
        followed = [follows_oracle(r) for r in runs]
        rewards = [r["reward"]["RL"] for r in runs]
        rows.append(
            [
                credit,
                f"{statistics.fmean(rewards):.3f} ({min(rewards):.3f}–{max(rewards):.3f})",
                fmt(envelope(runs, "rl_minus_warm_start")),
                f"{passes(runs, 'rl_minus_warm_start', 0)}/{len(runs)}",
                fmt(envelope(runs, "rl_minus_best_forced")),
                f"{sum(f for f, _ in followed)}/{sum(n for _, n in followed)}",
                f"{sum(r['skills_kept'] for r in runs)}/{len(runs)}",
            ]
        )
    return table(
        [
            "credit",
            "held-out reward after RL (seed range)",
            "RL − warm start",
            "seeds gaining",
            "RL − best forced style",
            "decision on the oracle's side (size, seed)",
            "seeds keeping every skill",
        ],
        rows,
    )


def width_table(records: list[dict]) -> str:
    """Clones of the root's first call where only delegation fits, per seed, warm start and
    after RL under each broadcast-credit cost."""
    rows = []
    for (name, credit), runs in by_setting(records).items():
        if credit != "broadcast":
            continue
        def clones(policy: str) -> list[float]:
            return [statistics.fmean(r["clones_per_call"][policy][i] for i in only_delegation(r))
                    for r in runs]

        per_seed, start = clones("RL"), clones("warm start")
        rows.append(
            [
                cost_label(runs[0]),
                ", ".join(f"{c:.2f}" for c in start),
                ", ".join(f"{c:.2f}" for c in per_seed),
                f"{statistics.fmean(per_seed):.2f}",
            ]
        )
    return table(["cost", "warm start, per seed", "after RL, per seed", "mean"], rows)


def forced_table(records: list[dict]) -> str:
    """The warm starts' forced styles and free decision per size (one row per seed)."""
    starts = {r["seed"]: r for r in records}
    sizes = next(iter(starts.values()))["sizes"]
    rows = []
    for seed, r in sorted(starts.items()):
        forced = r["forced"]["warm start"]
        rows.append(
            [str(seed)]
            + [
                f"{d:.2f} / {g:.2f} / {p:.2f}"
                for d, g, p in zip(
                    forced["direct"], forced["delegate"], r["p_delegate"]["warm start"]
                )
            ]
        )
    return table(["seed"] + [f"{s} keys" for s in sizes], rows)


def oracle_table(records: list[dict]) -> str:
    """Each run's oracle per size, judged with the warm start's and with the RL policy's weights."""
    rows = [
        [
            name,
            credit,
            str(r["seed"]),
            "".join(SHORT[o] for o in r["oracle"]),
            "".join(SHORT[o] for o in r["oracle_rl"]),
            " ".join(f"{p:.2f}" for p in r["p_delegate"]["RL"]),
        ]
        for (name, credit), runs in by_setting(records).items()
        for r in runs
    ]
    return table(
        ["setting", "credit", "seed", "oracle (warm start)", "oracle (RL)", "P(delegate) after RL"],
        rows,
    )


def main() -> None:
    records = load(Path(sys.argv[1])) if len(sys.argv) > 1 else load()
    for title, text in [
        ("README", readme_table(records)),
        ("warm starts: forced direct / forced delegate / P(delegate)", forced_table(records)),
        ("credit", credit_table(records)),
        ("width", width_table(records)),
        ("oracles", oracle_table(records)),
    ]:
        print(f"## {title}\n\n{text}\n")


if __name__ == "__main__":
    main()
