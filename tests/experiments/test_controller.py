"""The learned-controller experiment: its configs, held-out tasks by size, the training-speed
figure, the sweep's bookkeeping, and (slow) the quick variant end to end."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from selfcest import machine
from selfcest.configure import validate
from selfcest.eval.decisions import sample_trees
from selfcest.experiments import controller, controller_sweep
from selfcest.experiments.common import compose
from selfcest.experiments.controller import held_out_by_size, refresh, run, steps_to_fraction
from selfcest.experiments.controller_sweep import SweepConfig, sweep, write_summary
from selfcest.train.config import load_split

SETTINGS = {  # (per processed token, per critical-path token)
    "controller": (0.002, 0.0), "controller_free": (0.0, 0.0), "controller_low": (0.001, 0.0),
    "controller_latency": (0.0, 0.005), "controller_quick": (0.002, 0.0)}


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_composes_and_differs_only_in_its_cost(name):
    config, base = compose(name, []), compose("controller", [])
    validate(config)
    if name != "controller_quick":
        assert config.warm_start == base.warm_start  # one warm start serves every setting of a seed
        assert replace(config.trainer, output_dir="") == replace(base.trainer, output_dir="")
    cost = config.task.reward_params["cost"]
    assert SETTINGS[name] == (cost["per_processed_token"], cost.get("per_critical_path_token", 0.0))
    # clones' prompts and returns cost as much as generations
    assert cost.get("per_token", 0.0) == 0.0


def test_held_out_tasks_come_per_size_and_never_from_training():
    config = compose("controller_quick", ["eval.tasks_per_split=5"])
    tasks = held_out_by_size(config)
    assert Counter(len(t.context) for t in tasks) == {2: 5, 5: 5, 9: 5}
    assert not {t.prompt for t in tasks} & {t.prompt for t in load_split(config.task, "train")}


def test_steps_to_a_fraction_of_the_gain():
    history = [{"reward/mean": r} for r in [0.0] * 4 + [0.5] * 4 + [1.0] * 8]
    # running means over 4 steps: 0 until step 4, 0.125 ... 0.5 at step 8, 1.0 from step 12
    assert steps_to_fraction(history, 0.9) == 12
    assert steps_to_fraction(history, 0.5) == 8
    assert steps_to_fraction(list(reversed(history))) is None  # no gain
    assert steps_to_fraction(history[:5]) is None  # too short to tell


def results(name: str, seed: int, beats: bool) -> dict:
    rate = {"value": 0.5, "low": 0.4, "high": 0.6}
    sizes = [{"size": s, "delegation_rate": rate, "branching": None} for s in (2, 6)]
    record = {"name": name, "credit": "broadcast", "cost": "token", "lambda": 0.002, "seed": seed,
              "sizes": [2, 6], "boundary": {"warm start": 2, "RL": 6},
              "p_delegate": {"warm start": [0.5, 1.0], "RL": [0.1, 1.0]},
              "clones_per_call": {"warm start": [2.0, 3.0], "RL": [None, 2.5]},
              "oracle_rl": ["direct", "delegate"],
              "oracle": ["direct", "delegate"]}
    return {"name": name, "seed": seed, "reward": {"warm start": 0.1, "RL": 0.3},
            "rl_minus_start": {"value": 0.2, "low": 0.1 if beats else -0.1, "high": 0.3},
            "rl_minus_best_forced": {"value": 0.0, "low": -0.005, "high": 0.01},
            "beats_start": beats, "matches_best_forced": True, "decisive_sizes": [6],
            "indecisive_sizes": [2],
            "skills_kept": [{"size": 2, "style": "direct", "warm start": 1.0, "RL": 0.99,
                             "kept": True}],
            "decision_room": 0.05,
            "steps_to_90": 12, "per_size": {"warm start": sizes, "RL": sizes}, "record": record}


def test_the_sweep_shares_a_warm_start_per_seed_and_resumes(tmp_path, monkeypatch):
    config = SweepConfig(experiments=["controller_free", "controller"],
                         credit_experiment="controller",
                         credits=["broadcast", "ratio"], seeds=[0, 1], output_dir=str(tmp_path))
    assert config.runs() == [("controller_free", "broadcast"), ("controller", "broadcast"),
                             ("controller", "ratio")]
    done = tmp_path / "controller_free-broadcast" / "seed1"
    done.mkdir(parents=True)
    (done / "results.json").write_text(json.dumps(results("controller_free", 1, True)))
    calls = []

    def fake_run(train_config, log):
        calls.append((train_config.name, train_config.trainer.seed,
                      str(train_config.algo.credit.strategy),
                      train_config.warm_start.policy))
        arm = f"{train_config.name}-{train_config.algo.credit.strategy}"
        folder = tmp_path / arm / f"seed{train_config.trainer.seed}"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(
            json.dumps(results(train_config.name, train_config.trainer.seed, False)))

    monkeypatch.setattr(controller_sweep, "run", fake_run)
    refreshed = []
    monkeypatch.setattr(controller_sweep, "refresh", lambda c,
                        log: refreshed.append(c.trainer.output_dir))
    summary = sweep(config, log=lambda message: None).read_text()
    assert refreshed == []  # finished runs are left as they are unless asked
    sweep(replace(config, refresh=True), log=lambda message: None)
    assert len(refreshed) == 6 and len(calls) == 5
    first = str(tmp_path / "controller_free-broadcast" / "seed0" / "sft")
    assert calls == [("controller_free", 0, "broadcast", None),
                     ("controller", 0, "broadcast", first),
                     ("controller", 0, "ratio", first),  # seed 1's first run was done already
                     ("controller", 1, "broadcast", str(done / "sft")),
                     ("controller", 1, "ratio", str(done / "sft"))]
    assert "| controller_free | broadcast | 2 | 0.300 | +0.200 | 1/2 |" in summary
    assert ("| controller_free | broadcast | token | 0.002 | 6, 6 | 2: 0.10 6: 1.00 | 2: – 6: 2.50 "
            "| DG DG |") in summary
    assert (tmp_path / "delegation_rate.png").stat().st_size > 0 and (
        tmp_path / "decisions.png").stat().st_size > 0
    assert ("controller_free (broadcast), seed 1: RL − warm start +0.200 [+0.100, +0.300]: "
            "**gains**") in summary
    assert "seed 0: RL − warm start +0.200 [-0.100, +0.300]: **does not gain**" in summary
    records = json.loads((tmp_path / "controller_sweep.json").read_text())
    assert sorted((r["name"], r["seed"]) for r in records) == [
        ("controller", 0), ("controller", 0), ("controller", 1), ("controller", 1),
        ("controller_free", 0), ("controller_free", 1)]


def test_a_summary_before_any_run_says_so(tmp_path):
    text = write_summary(tmp_path, SweepConfig(output_dir=str(tmp_path))).read_text()
    assert "Runs found under" in text and ": 0 of 7 settings" in text
    assert json.loads((tmp_path / "controller_sweep.json").read_text()) == []


def test_quick_controller_run_measures_every_mode_and_reports(tmp_path, monkeypatch):
    config = compose("controller_quick", [f"trainer.output_dir={tmp_path}", "log.progress=false"])
    summary = run(config, log=lambda message: None)
    rows = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    # 2 policies x 3 modes x (2 trained sizes + OOD) x 8 tasks x 1 sample
    assert Counter((r["policy"], r["mode"])
                   for r in rows) == {(p, m): 24 for p in ("warm start", "RL")
                                     for m in ("free", "direct", "delegate")}
    assert all(r["delegated"] for r in rows if r["mode"] == "delegate")
    assert not any(r["clones"] for r in rows if r["mode"] == "direct")
    assert [row["size"] for row in summary["per_size"]["RL"]] == [2, 5, 9]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["seed"] == 0 and saved["record"]["sizes"] == [2, 5]
    assert set(saved["record"]["oracle"]) <= {"direct", "delegate", "tie"}
    # The warm start was validated, and the training steps logged P(delegate) per size.
    sft = [json.loads(line) for line in (tmp_path / "sft" / "sft.jsonl").read_text().splitlines()]
    scores = {step["step"]: step["sft/validation"] for step in sft if "sft/validation" in step}
    assert list(scores) == [100, 200]
    best = max(scores.values())
    kept = min(step for step, score in scores.items() if score == best)  # train_sft keeps the first
    assert saved["warm_start"] == {"attempt": 0, "attempts": 1, "step": kept, "validation": best}
    assert set(summary["training_rate"]) == {2, 5} and len(summary["training_rate"][2]) == 3
    # RL ended with its best-evaluated weights (the earliest best, the warm start's included),
    # and those are what was measured.
    kept_rl = saved["rl_kept"]
    values = [e["value"] for e in kept_rl["evaluations"]]
    assert [e["step"] for e in kept_rl["evaluations"]] == [0, 1, 2, 3]
    assert kept_rl["step"] == values.index(max(values)) and kept_rl["value"] == max(values)
    best = tmp_path / "rl" / "best" / "checkpoints" / f"step_{kept_rl['step']:06d}"
    measured = load_file(tmp_path / "rl" / "policy" / "model.safetensors")
    assert all(torch.equal(measured[name], value) for name, value in
               load_file(best / "model.safetensors").items())
    report = (tmp_path / "report.md").read_text()
    assert "## Before RL: the forced styles of the warm start" in report and "## Verdicts" in report
    met = saved["warm_start"]["validation"] >= config.warm_start.sft.validation_target
    assert f"Warm start kept: step {saved['warm_start']['step']} of attempt 1 (1 made)" in report
    assert ("target met" in report) == met and ("**target missed**" in report) == (not met)
    assert f"RL kept: the weights of step {kept_rl['step']} of 3" in report
    # The machine it ran on, as RL ran it (trainer.cpu_threads: 1).
    assert saved["machine"]["threads"] == 1 and "1 thread(s)" in report
    assert f"on {torch.backends.cpu.get_cpu_capability()} kernels" in report
    for name in ("delegation_rate.png", "branching.png", "training_curve.png", "training_rate.png",
                 "rl/policy/config.json", "sft/decision_trees.jsonl"):
        assert (tmp_path / name).stat().st_size > 0, name
    # Summarizing the finished run again from what it saved gives the same summary, and names
    # the machine the run came from, not the one summarizing it.
    (tmp_path / "report.md").unlink()
    with monkeypatch.context() as patch:
        patch.setattr(machine, "describe", lambda: {"cpu": "the summarizing machine"})
        refreshed = refresh(config, log=lambda message: None)
    assert json.loads(json.dumps(refreshed)) == saved and (tmp_path / "report.md").exists()
    # A second setting of the seed re-scores the warm start's trees instead of sampling them.
    again = compose("controller_quick",
                    [f"trainer.output_dir={tmp_path / 'free'}", "log.progress=false",
                     f"warm_start.policy={tmp_path / 'sft'}",
                     "task.reward_params.cost.per_processed_token=0.0"])
    sampled = []

    def counting(policy, tasks, mode, *args, **kwargs):
        sampled.append(mode)
        return sample_trees(policy, tasks, mode, *args, **kwargs)

    monkeypatch.setattr(controller, "sample_trees", counting)
    free = run(again, log=lambda message: None)
    assert len(sampled) == 3  # the RL policy's three modes; the warm start's came from its folder
    before = {r["size"]: r["accuracy"]["delegate"]["value"]
              for r in summary["per_size"]["warm start"]}
    assert {r["size"]: r["accuracy"]["delegate"]["value"]
            for r in free["per_size"]["warm start"]} == before


def test_a_warm_start_saved_before_an_interruption_is_not_trained_again(tmp_path, monkeypatch):
    config = SweepConfig(experiments=["controller"], credits=["broadcast"], seeds=[0],
                         output_dir=str(tmp_path))
    saved = tmp_path / "controller-broadcast" / "seed0" / "sft"
    saved.mkdir(parents=True)
    (saved / "config.json").write_text("{}")
    policies = []

    def fake_run(train_config, log):
        policies.append(train_config.warm_start.policy)
        (saved.parent / "results.json").write_text(json.dumps(results("controller", 0, True)))

    monkeypatch.setattr(controller_sweep, "run", fake_run)
    sweep(config, log=lambda message: None)
    assert policies == [str(saved)]
