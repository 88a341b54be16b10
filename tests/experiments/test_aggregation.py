"""The loss-aggregation experiment: every aggregation trained from one warm start, each
measured on the held-out splits and compared with token_mean."""

from __future__ import annotations

from selfcest.algo.losses import AGGREGATIONS
from selfcest.experiments import aggregation
from selfcest.policy import ClonePolicy


def test_every_aggregation_trains_from_the_warm_start_and_is_compared_with_token_mean(
    tiny_cpu_repro, tmp_path):
    results = aggregation.run(tiny_cpu_repro(tmp_path, "trainer.steps=1", "eval.reward_samples=1"),
                              log=lambda message: None)
    assert [row["aggregation"] for row in results["runs"]] == list(AGGREGATIONS)
    for mode in AGGREGATIONS:
        # each trained and saved
        assert ClonePolicy.from_pretrained(tmp_path / f"{mode}_seed0" / "policy")
    token_mean = [row for row in results["summary"] if row["aggregation"] == "token_mean"]
    # compared with itself
    assert all(row["vs_token_mean"] == [0.0, 0.0, 0.0] for row in token_mean)
    assert (tmp_path / "report.md").read_text().count("| seq_mean_token_mean | ") >= 2
