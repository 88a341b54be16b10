"""Evaluation: outputs of a tiny-model sweep, method logic with known accuracies, voting,
configuration errors, the plain-argument entry point, bootstrap intervals."""

from __future__ import annotations

import csv
import importlib
import json
import re
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
import torch
from eval_helpers import (
    ScriptedPolicy,
    delegation_script,
    exact_match,
    inline_view,
    keyed_tasks,
)
from matplotlib.image import imread

from selfcest.budget import Budget
from selfcest.eval import (
    EvalResults,
    Method,
    bootstrap_mean,
    bootstrap_ratio,
    evaluate,
    majority_vote,
    normalize_answer,
    read_trees,
    run_evaluation,
)
from selfcest.eval.cli import run_eval
from selfcest.eval.config import EvalConfig
from selfcest.task import Task
from selfcest.train.config import TaskSourceConfig

# The module (selfcest.eval exports its function of the same name).
evaluate_module = importlib.import_module("selfcest.eval.evaluate")
BASE = Budget(node_generation=64, tree_generation=64, node_context=512)


@pytest.fixture
def scripted(tiny_policy) -> ScriptedPolicy:
    """A perfect delegator for `keyed_tasks` (see `delegation_script`)."""
    return ScriptedPolicy(tiny_policy.protocol, delegation_script)


def test_tiny_model_sweep_writes_every_output_with_consistent_numbers(tiny_policy, tmp_path):
    splits = {"id": keyed_tasks(3), "ood": keyed_tasks(2, keys=4, prefix="o")}
    methods = [
        Method("clones", "clones", BASE),
        Method("monolithic", "monolithic", BASE),
        Method("sc@2", "self_consistency", BASE, samples=2),
    ]
    results = evaluate(tiny_policy, methods, splits, [32, 16], exact_match, tmp_path, seed=3)

    names = {"results.json", "results.csv", "results.md", "pareto_total_tokens.png",
             "pareto_critical_path.png", "trees"}
    assert names <= {p.name for p in tmp_path.iterdir()}
    assert results.budgets == [16, 32]
    assert len(results.cells) == 3 * 2 * 2
    assert EvalResults.load(tmp_path / "results.json").to_dict() == results.to_dict()

    for cell in results.cells:
        assert 0 <= cell.accuracy.low <= cell.accuracy.value <= cell.accuracy.high <= 1
        assert cell.total_tokens.low <= cell.total_tokens.value <= cell.total_tokens.high
        assert 0 < cell.total_tokens.value <= cell.budget
        assert cell.critical_path_tokens.value <= cell.total_tokens.value
        for rate in (cell.spawn_error_rate, cell.budget_truncated_rate, cell.error_rate):
            assert 0 <= rate <= 1
        # The saved trees are what the cell's figures were computed from.
        trees = read_trees(tmp_path / cell.trees_file)
        samples = 2 if cell.kind == "self_consistency" else 1
        assert len(trees) == cell.tasks * samples == len(splits[cell.split]) * samples
        by_task = defaultdict(list)
        for tree in trees:
            assert (tree.info["method"], tree.info["budget"], tree.info["split"]) == (
                cell.method, cell.budget, cell.split)
            assert tree.correct is not None and tree.reward is not None
            assert tree.costs().generated_tokens <= cell.budget // samples
            if cell.kind != "clones":
                assert tree.costs().clones == 0
            by_task[tree.task_id].append(tree.costs())
        totals = [sum(c.generated_tokens for c in costs) for costs in by_task.values()]
        paths = [max(c.critical_path_tokens for c in costs) for costs in by_task.values()]
        assert cell.total_tokens.value == pytest.approx(np.mean(totals))
        assert cell.critical_path_tokens.value == pytest.approx(np.mean(paths))

    with open(tmp_path / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(results.cells)
    for row in rows:
        cell = results.cell(row["method"], int(row["budget"]), row["split"])
        assert float(row["accuracy_high"]) == pytest.approx(cell.accuracy.high)
        assert float(row["total_tokens"]) == pytest.approx(cell.total_tokens.value)
        assert float(
            row["critical_path_tokens_low"]) == pytest.approx(cell.critical_path_tokens.low)

    markdown = (tmp_path / "results.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| method | budget |"))
    assert "| id accuracy |" in header and "| ood accuracy |" in header  # splits side by side
    for cell in results.cells:
        assert re.search(rf"^\| {re.escape(cell.method)} \| {cell.budget} \|", markdown, re.M)

    for name in ("pareto_total_tokens.png", "pareto_critical_path.png"):
        image = imread(tmp_path / name)
        assert image.shape[1] > image.shape[0]  # two panels side by side
        assert image[..., :3].std() > 0.05  # something was drawn


def test_scripted_methods_reach_their_known_accuracies(scripted, tmp_path):
    splits = {"id": keyed_tasks(3), "ood": keyed_tasks(2, keys=3, prefix="o")}
    methods = [
        Method("clones", "clones", BASE),
        Method("monolithic", "monolithic", BASE),
        Method("inline", "monolithic", BASE, task_view=inline_view),
    ]
    results = evaluate(scripted, methods, splits, [8, 64], exact_match, tmp_path)

    for split in splits:
        delegated = results.cell("clones", 64, split)
        assert delegated.accuracy.value == 1.0
        assert delegated.clones == (2 if split == "id" else 3)  # one clone per key
        assert delegated.spawn_error_rate == 0
        assert delegated.critical_path_tokens.value < delegated.total_tokens.value
        # Eight tokens cannot even close the spawn call: truncated, no answer.
        starved = results.cell("clones", 8, split)
        assert (starved.accuracy.value, starved.budget_truncated_rate) == (0.0, 1.0)
        # Spawning is disabled for the monolithic arm: a call does not stop the root, and a turn
        # that holds one is no answer (nothing is refused: no spawn error).
        written = results.cell("monolithic", 64, split)
        assert (written.accuracy.value, written.clones, written.spawn_error_rate) == (0.0, 0.0, 0.0)
        # The same arm reading the lists inline (its task view) solves every task.
        assert results.cell("inline", 8, split).accuracy.value == 1.0
        assert results.cell("inline", 8, split).spawn_error_rate == 0

    clone_budgets = [b for b in scripted.budgets if b.max_depth > 0]
    assert len(clone_budgets) == 2 and len(scripted.budgets) == 6  # splits share one rollout
    assert {b.tree_generation for b in scripted.budgets} == {8, 64}
    assert all(b.node_generation <= b.tree_generation for b in scripted.budgets)


VOTES = {  # task -> the answer of each of its samples, in sampling order
    "A": ["5", "6", "6"],  # majority 6: right
    "B": ["3", "3", "9"],  # majority 3: right
    "C": ["2", "2", "1"],  # majority 2: wrong (the reference is 1)
    "D": ["", "", "4"],  # two samples never answer; silence does not outvote 4: right
}
REFERENCE = {"A": "6", "B": "3", "C": "1", "D": "4"}


def counting_script():
    calls: dict[str, int] = defaultdict(int)

    def respond(text: str) -> str:
        task = re.search(r"Vote task (\w)", text).group(1)
        answer = VOTES[task][calls[task]]
        calls[task] += 1
        return f"Answer: {answer}" if answer else ""

    return respond


def test_self_consistency_votes_within_a_split_budget(tiny_policy, tmp_path):
    policy = ScriptedPolicy(tiny_policy.protocol, counting_script)
    tasks = [Task(name, f"Vote task {name}.", answer) for name, answer in REFERENCE.items()]
    methods = [Method("mono", "monolithic", BASE),
               Method("sc", "self_consistency", BASE, samples=3)]
    results = evaluate(policy, methods, {"all": tasks}, [31], exact_match, tmp_path)

    # Monolithic reads only each task's first sample: A 5, B 3, C 2, D (nothing).
    assert results.cell("mono", 31, "all").accuracy.value == pytest.approx(1 / 4)
    assert results.cell("sc", 31, "all").accuracy.value == pytest.approx(3 / 4)

    sc_budget = policy.budgets[1]
    assert (sc_budget.tree_generation, sc_budget.node_generation,
            sc_budget.max_depth) == (10, 10, 0)
    assert all(call.max_tokens <= 10 for call in policy.backends[1].calls)

    cell = results.cell("sc", 31, "all")
    trees = read_trees(tmp_path / cell.trees_file)
    assert cell.trees == len(trees) == 12
    by_task = defaultdict(list)
    for tree in trees:
        by_task[tree.task_id].append(tree)
    for name, group in by_task.items():
        elected = [t for t in group if t.info["vote"]["elected"]]
        assert len(elected) == 1
        assert elected[0].correct == (REFERENCE[name] != "1")
        assert group[0].info["vote"]["samples"] == 3
    costs = [[t.costs() for t in group] for group in by_task.values()]
    assert cell.total_tokens.value == pytest.approx(
        np.mean([sum(c.generated_tokens for c in g) for g in costs]))
    assert cell.critical_path_tokens.value == pytest.approx(
        np.mean([max(c.critical_path_tokens for c in g) for g in costs]))
    assert cell.total_tokens.value <= 31


def test_majority_vote_normalises_ignores_silence_and_breaks_ties_by_first_sample():
    assert majority_vote(["1,234.", " 1234", "7"]) == majority_vote(["1234", "1234", "7"])
    assert majority_vote(["1,234.", " 1234", "7"]).count == 2
    assert majority_vote(["b", "a", "a", "b"]).answer == "b"  # tie: b was given first
    assert majority_vote(["a", "b", "b", "a"]).index == 0
    assert majority_vote(["", "", "x"]).answer == "x"
    assert majority_vote(["", "  "]).answer == "" and majority_vote(["", ""]).count == 0
    assert majority_vote(["X", "y"], normalize=str.strip).answer == "X"
    with pytest.raises(ValueError):
        majority_vote([])


def test_normalize_answer():
    assert normalize_answer("  Paris. ") == "paris"
    assert normalize_answer("1,234,567") == "1234567"
    assert normalize_answer("1,23") == "1,23"  # not a thousands separator
    assert normalize_answer("New   York") == "new york"


class RefusingPolicy:
    def engine(self, budget, sampling, seed):
        raise AssertionError("a bad configuration must fail before any rollout")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(budgets=[2]), "cannot be split into 3 samples"),
        (dict(budgets=[0]), "positive integers"),
        (dict(budgets=[8, 8]), "repeat"),
        (dict(splits={"id": []}), "has no task"),
        (dict(splits={"a b": [Task("x", "?", "1")], "a/b": [Task("y", "?", "1")]}), "unique"),
        (dict(methods=[Method("m", "monolithic"), Method("m", "clones")]), "unique"),
        (dict(policy=None), "has no policy"),
        (dict(bootstrap_samples=0), "bootstrap_samples"),
    ],
)
def test_bad_configurations_fail_before_any_rollout(change, message):
    arguments = dict(
        policy=RefusingPolicy(),
        methods=[Method("sc", "self_consistency", samples=3)],
        splits={"id": [Task("x", "?", "1")]},
        budgets=[8],
    )
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        evaluate(reward_fn=exact_match, **arguments)


def test_method_validation():
    with pytest.raises(ValueError, match="kind"):
        Method("m", "beam")
    with pytest.raises(ValueError, match="only self_consistency"):
        Method("m", "monolithic", samples=2)
    with pytest.raises(ValueError, match="allows spawning"):
        Method("m", "clones", replace(BASE, max_depth=0))
    method = Method("m", "monolithic", replace(BASE, max_depth=2, node_generation=64))
    assert method.tree_budget(16) == replace(BASE, max_depth=0, node_generation=16,
                                             tree_generation=16)
    assert method.tree_budget(1000).node_generation == 64


def test_run_evaluation_with_plain_arguments(scripted, tmp_path):
    tasks_file = tmp_path / "id.jsonl"
    tasks_file.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in keyed_tasks(2)))
    results = run_evaluation(
        model=scripted,
        tasks={"id": tasks_file, "ood": keyed_tasks(1, keys=3, prefix="o")},
        budgets=[64],
        methods=[
            {"name": "clones", "kind": "clones"},
            {"name": "flat", "kind": "monolithic", "budget": {"node_generation": 48}},
        ],
        reward_fn=exact_match,
        out_dir=tmp_path / "out",
        budget={"node_generation": 32, "node_context": 512},
        temperature=0.0,
    )
    assert results.splits == {"id": 2, "ood": 1}
    assert results.cell("clones", 64, "id").accuracy.value == 1.0
    assert [(b.node_generation, b.max_depth) for b in scripted.budgets] == [(32, 1), (48, 0)]
    assert results.settings["sampling"]["temperature"] == 0.0
    assert (tmp_path / "out" / "results.md").exists()

    with pytest.raises(ValueError, match="unknown field"):
        run_evaluation(scripted, {"id": tasks_file}, [64],
                       [{"name": "x", "kind": "clones", "k": 2}],
                       exact_match, tmp_path / "bad")


def test_a_saved_policy_is_evaluated_on_this_processs_gpu_or_the_given_device(
    tiny_policy, tmp_path, monkeypatch):
    """``selfcest-eval`` loads a saved policy where it decodes: with ``device=auto`` this
    process's GPU where there is one (`default_device`; pretended here by "meta"), else the
    device named."""
    tiny_policy.save_pretrained(tmp_path / "policy")
    monkeypatch.setattr(evaluate_module, "default_device", lambda: torch.device("meta"))
    seen = []

    def record(policy, *args, **kwargs):
        seen.append(next(policy.model.parameters()).device)
        return EvalResults(cells=[], splits={}, methods=[], budgets=[])

    monkeypatch.setattr(evaluate_module, "evaluate", record)
    for device in ("auto", "cpu"):
        run_eval(EvalConfig(policy=str(tmp_path / "policy"), device=device,
                            out_dir=str(tmp_path / device),
                            splits={"id": TaskSourceConfig("keyed_sum", {"split": "test"})},
                            tasks_per_split=1))
    assert seen == [torch.device("meta"), torch.device("cpu")]


# ---------------------------------------------------------------------------- bootstrap


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_more_tasks():
    rng = np.random.default_rng(0)
    widths = {}
    for n in (25, 400):
        for data in (rng.random(n) < 0.3, rng.exponential(100.0, n)):
            estimate = bootstrap_mean(data.astype(float), resamples=1000, seed=1)
            assert estimate.value == pytest.approx(data.mean())
            assert estimate.low < estimate.value < estimate.high
        widths[n] = estimate.high - estimate.low
    # The width scales as 1/sqrt(n): 16 times the tasks, about a quarter of the width.
    assert widths[400] < 0.5 * widths[25]


def test_bootstrap_ratio_resamples_groups_not_items():
    """A group's items move together: giving every group k times its items (same fraction)
    leaves the interval as it is, where resampling the items would narrow it; with one item
    per group it is bootstrap_mean."""
    rng = np.random.default_rng(0)
    items = rng.integers(1, 6, 40)
    hits = rng.binomial(items, 0.7)
    base = bootstrap_ratio(hits, items, seed=2)
    assert base.value == pytest.approx(
        hits.sum() / items.sum()) and base.low < base.value < base.high
    assert bootstrap_ratio(5 * hits, 5 * items, seed=2) == pytest.approx(base)
    per_item = bootstrap_mean([float(i < h) for h, n in zip(5 * hits, 5 * items) for i in range(n)],
                              seed=2)
    assert per_item.high - per_item.low < 0.7 * (base.high - base.low)
    flags = (rng.random(30) < 0.4).astype(float)
    assert bootstrap_ratio(flags, np.ones(30),
                           seed=3) == pytest.approx(bootstrap_mean(flags, seed=3))
    for bad in (([1.0], [0.0]), ([1.0], [1.0, 2.0]), ([], [])):
        with pytest.raises(ValueError):
            bootstrap_ratio(*bad)


def test_bootstrap_is_seeded_and_degenerate_cases_are_clear():
    data = list(np.random.default_rng(0).random(30))
    assert bootstrap_mean(data, seed=4) == bootstrap_mean(data, seed=4)
    assert bootstrap_mean(data, seed=4) != bootstrap_mean(data, seed=5)
    constant = bootstrap_mean([3.0] * 5)
    assert (constant.low, constant.value, constant.high) == (3.0, 3.0, 3.0)
    wider = bootstrap_mean(data, level=0.99, seed=4)
    narrower = bootstrap_mean(data, level=0.5, seed=4)
    assert wider.high - wider.low > narrower.high - narrower.low
    for bad in ([], [[1.0]]):
        with pytest.raises(ValueError):
            bootstrap_mean(bad)
