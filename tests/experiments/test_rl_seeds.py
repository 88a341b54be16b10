"""RL seeds from one warm start: each seed trains its own policy, measured paired with the
warm start on the same held-out tasks."""

from __future__ import annotations

import json

import pytest
import torch

from selfcest.configure import ConfigError
from selfcest.experiments.rl_seeds import run
from selfcest.policy import ClonePolicy


def quietly(config):
    return run(config, log=lambda message: None)


def test_every_seed_trains_its_own_policy_and_is_measured_against_the_warm_start(tiny_cpu_repro, tmp_path):
    config = tiny_cpu_repro(tmp_path, "eval.seeds=2")
    results = quietly(config)
    assert results["seeds"] == [0, 1]
    start = ClonePolicy.from_pretrained(config.warm_start.policy).model.state_dict()
    trained = [ClonePolicy.from_pretrained(tmp_path / f"seed{s}/policy").model.state_dict() for s in (0, 1)]
    assert any(not torch.equal(start[k], trained[0][k]) for k in start)  # RL moved the weights
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in start)  # and the seeds differ
    for row in results["runs"]:
        assert set(row["gain"]) == {"in-distribution", "out-of-distribution"}
    report = (tmp_path / "report.md").read_text()
    assert report.count("| 0 | ") == 2 and report.count("| 1 | ") == 2  # a row per seed and split
    assert json.loads((tmp_path / "results.json").read_text())["summary"].keys() == {
        "in-distribution", "out-of-distribution"}


def test_without_learning_the_first_seed_measures_exactly_the_warm_start(tiny_cpu_repro, tmp_path):
    """At lr 0 seed 0's policy is the warm start, sampled with the same engine seed on the
    same tasks: a paired difference of exactly 0, on every split."""
    results = quietly(tiny_cpu_repro(tmp_path, "trainer.lr=0"))
    for gain in results["runs"][0]["gain"].values():
        assert gain == [0.0, 0.0, 0.0]


def test_a_missing_warm_start_is_a_config_error(tiny_cpu_repro, tmp_path):
    with pytest.raises(ConfigError, match="warm_start.policy is required"):
        quietly(tiny_cpu_repro(tmp_path, "warm_start.policy=null"))
