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


def test_every_seed_trains_its_own_policy_and_is_measured_against_the_warm_start(
    tiny_cpu_repro, tmp_path):
    config = tiny_cpu_repro(tmp_path, "eval.seeds=2")
    results = quietly(config)
    assert results["seeds"] == [0, 1]
    start = ClonePolicy.from_pretrained(config.warm_start.policy).model.state_dict()
    trained = [ClonePolicy.from_pretrained(tmp_path / f"seed{s}/policy").model.state_dict()
               for s in (0, 1)]
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


def test_a_stopped_run_resumes_with_the_seeds_it_finished(tiny_cpu_repro, tmp_path):
    first = quietly(tiny_cpu_repro(tmp_path, "eval.seeds=1"))
    policy = tmp_path / "seed0/policy/model.safetensors"
    trained_at = policy.stat().st_mtime_ns
    messages = []
    resumed = run(tiny_cpu_repro(tmp_path, "eval.seeds=2"), log=messages.append)
    assert policy.stat().st_mtime_ns == trained_at  # seed 0 was not trained again...
    assert f"reusing {tmp_path / 'seed0/result.json'}" in messages
    assert resumed["runs"][0] == first["runs"][0]  # ...its measurement was kept
    assert resumed[
        "summary"]["in-distribution"]["start"] == first["summary"]["in-distribution"]["start"]
    assert (tmp_path / "seed1/policy").exists()  # and the new seed was trained


def test_a_finished_seed_of_another_config_is_trained_again(tiny_cpu_repro, tmp_path):
    quietly(tiny_cpu_repro(tmp_path, "eval.seeds=1"))
    policy = tmp_path / "seed0/policy/model.safetensors"
    trained_at = policy.stat().st_mtime_ns
    messages = []
    run(tiny_cpu_repro(tmp_path, "eval.seeds=1", "trainer.lr=0"), log=messages.append)
    assert policy.stat().st_mtime_ns != trained_at
    assert any("measured under another config" in m for m in messages)
