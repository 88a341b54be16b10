"""The committed sweep results and the tables read from them: the README quotes what the
records say, and the records hold every field a user of the JSON reads."""

from __future__ import annotations

from helpers import REPO

from selfcest.experiments.controller_results import (
    by_setting,
    envelope,
    follows_oracle,
    load,
    passes,
    readme_table,
)


def record(
    name="controller",
    seed=0,
    p_rl=(0.1, 0.9),
    oracle=("direct", "delegate"),
    gain=(0.01, 0.05, 0.09),
):
    return {
        "name": name,
        "credit": "broadcast",
        "seed": seed,
        "cost": "token",
        "lambda": 0.002,
        "sizes": [2, 5],
        "p_delegate": {"warm start": [0.5, 1.0], "RL": list(p_rl)},
        "oracle": list(oracle),
        "oracle_rl": list(oracle),
        "forced": {"warm start": {"direct": [0.9, 0.1], "delegate": [0.9, 0.9]}},
        "clones_per_call": {"warm start": [2.0, 3.0], "RL": [2.0, 2.5]},
        "boundary": {"RL": 5},
        "rl_minus_warm_start": list(gain),
        "rl_minus_best_forced": [-0.02, 0.01, 0.04],
    }


def test_the_committed_records_hold_every_field_of_every_run():
    records = load()
    groups = by_setting(records)
    assert len(groups) == 7 and all(
        sorted(r["seed"] for r in runs) == [0, 1, 2] for runs in groups.values()
    )
    for r in records:
        sizes = r["sizes"]
        assert r["cost"] in ("none", "token", "latency") and isinstance(r["lambda"], float)
        assert (r["cost"] == "none") == (r["lambda"] == 0.0)
        assert set(r["oracle"]) <= {"direct", "delegate", "tie"} and len(r["oracle"]) == len(sizes)
        for policy in ("warm start", "RL"):
            assert len(r["p_delegate"][policy]) == len(sizes)
            assert all(
                len(r["forced"][policy][mode]) == len(sizes) for mode in ("direct", "delegate")
            )
        for key in ("rl_minus_warm_start", "rl_minus_best_forced"):
            low, mean, high = r[key]
            assert low <= mean <= high


def test_the_readmes_controller_table_is_the_one_the_records_give():
    assert readme_table(load()) in (REPO / "README.md").read_text()


def test_the_decision_is_on_the_oracles_side_only_past_its_threshold():
    assert follows_oracle(record(p_rl=(0.2, 0.8))) == (2, 2)
    assert follows_oracle(record(p_rl=(0.21, 0.79))) == (0, 2)
    assert follows_oracle(record(oracle=("tie", "delegate"), p_rl=(0.5, 0.9))) == (
        1,
        1,
    )  # a tie asks nothing


def test_an_interval_over_seeds_spans_every_seeds_interval():
    runs = [record(seed=0, gain=(0.01, 0.05, 0.09)), record(seed=1, gain=(-0.02, 0.0, 0.03))]
    assert envelope(runs, "rl_minus_warm_start") == (-0.02, 0.025, 0.09)
    assert passes(runs, "rl_minus_warm_start", 0.0) == 1
