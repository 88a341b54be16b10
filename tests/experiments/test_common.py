"""The validated warm start's restarts (selfcest.experiments.common.validated_sft): scripted
validation scores, real SFT steps on the tiny CPU reproduction."""

from __future__ import annotations

import json

import pytest

from selfcest.configure import ConfigError
from selfcest.experiments import common
from selfcest.experiments.common import kept_checkpoint, validated_sft, warm_start_folder
from selfcest.train.config import validate

RESTARTS = ["warm_start.policy=null", "warm_start.sft.steps=4", "warm_start.sft.validate_every=2",
            "warm_start.sft.validation_target=0.9", "warm_start.restarts=2"]


def scripted(scores: list[list[float]], monkeypatch):
    """A validation score reading ``scores[attempt]`` in turn, and the list of (init seed,
    sequence-order seed, policy) each attempt built its fresh model with."""
    built = []
    build = common.build_policy

    def build_policy(config):
        policy = build(config)
        built.append((config.model.init_seed, config.warm_start.sft.seed, policy))
        return policy

    monkeypatch.setattr(common, "build_policy", build_policy)
    pending = {}

    def score(policy):
        attempt = [entry[2] for entry in built].index(policy)
        pending.setdefault(attempt, list(scores[attempt]))
        return pending[attempt].pop(0)
    return score, built


def test_sft_restarts_from_fresh_seeds_until_a_validation_meets_the_target(
        tiny_cpu_repro, tmp_path, monkeypatch):
    score, built = scripted([[0.2, 0.5], [0.7, 0.3], [0.4, 0.6]], monkeypatch)
    config = tiny_cpu_repro(tmp_path, *RESTARTS)
    messages = []
    policy, history = validated_sft(config, messages.append, score)

    seeds = [(init, order) for init, order, _ in built]
    base = (config.model.init_seed, config.warm_start.sft.seed)
    assert seeds == [base, (base[0] + 1000, base[1] + 1), (base[0] + 2000, base[1] + 2)]
    assert policy is built[1][2]  # the best score of all attempts (0.7) is kept
    assert [(h["attempt"], h["step"], h.get("sft/validation")) for h in history] == [
        (0, 1, None), (0, 2, 0.2), (0, 3, None), (0, 4, 0.5),
        (1, 1, None), (1, 2, 0.7), (1, 3, None), (1, 4, 0.3),
        (2, 1, None), (2, 2, 0.4), (2, 3, None), (2, 4, 0.6)]
    restarted = [m for m in messages if "SFT again" in m]
    assert restarted == ["warm start: best validation 0.500 < target 0.9: SFT again from a "
                         "fresh model (restart 1 of 2)",
                         "warm start: best validation 0.700 < target 0.9: SFT again from a "
                         "fresh model (restart 2 of 2)"]


def test_sft_stops_restarting_at_the_first_attempt_that_meets_the_target(
        tiny_cpu_repro, tmp_path, monkeypatch):
    score, built = scripted([[0.2, 0.5], [0.95, 0.1], [1.0, 1.0]], monkeypatch)
    config = tiny_cpu_repro(tmp_path, *RESTARTS)
    folder = warm_start_folder(config, tmp_path / "sft", lambda message: None, score)

    assert len(built) == 2  # the third fresh model is never built
    lines = [json.loads(line) for line in open(folder / "sft.jsonl")]
    # train_sft stops at the score that meets the target: attempt 1 ran 2 of its 4 steps
    assert [(line["attempt"], line["step"]) for line in lines] == [
        (0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]
    assert kept_checkpoint(folder) == {"attempt": 1, "step": 2, "validation": 0.95, "attempts": 2}


def test_the_kept_checkpoint_of_a_log_without_attempts_or_validations(tmp_path):
    """Warm starts saved before restarts existed have no ``attempt``; unvalidated ones no
    score. Equal best scores keep the first, as train_sft does."""
    lines = [{"step": 1, "sft/loss": 2.0}, {"step": 2, "sft/validation": 0.5},
             {"step": 3, "sft/validation": 0.5}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert kept_checkpoint(tmp_path) == {"attempt": 0, "step": 2, "validation": 0.5, "attempts": 1}
    (tmp_path / "sft.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert kept_checkpoint(tmp_path) is None


def test_without_restarts_one_attempt_is_the_warm_start(tiny_cpu_repro, tmp_path, monkeypatch):
    score, built = scripted([[0.2, 0.5]], monkeypatch)
    config = tiny_cpu_repro(tmp_path, *RESTARTS[:-1])
    policy, history = validated_sft(config, lambda message: None, score)
    assert [entry[2] for entry in built] == [policy]
    assert {h["attempt"] for h in history} == {0}


@pytest.mark.parametrize("missing", ["warm_start.validation_tasks=0",
                                     "warm_start.sft.validate_every=0"])
def test_restarts_without_validation_fail_before_any_compute(tiny_cpu_repro, tmp_path, missing):
    with pytest.raises(ConfigError, match="warm_start.restarts.*set warm_start.validation_tasks"):
        validate(tiny_cpu_repro(tmp_path, *RESTARTS, missing))
