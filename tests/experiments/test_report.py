"""The CPU reproduction's ``report.md``, rendered from a small fixed evaluation (no training,
no rollout): its sections, tables and numbers, and the trace page beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfcest.eval.report import markdown_report
from selfcest.eval.results import CellResult, EvalResults
from selfcest.eval.stats import Estimate
from selfcest.experiments.common import compose
from selfcest.experiments.cpu_repro import monolithic_twin
from selfcest.experiments.report import rl_verdict, write_repro_report
from selfcest.train.config import EvaluationConfig
from selfcest.tree import CloneTree, Node, Segment

SPLITS = ("in-distribution", "out-of-distribution")
BUDGETS = (256, 1024)  # the quick config trains at a tree budget of 1024
TASKS = 4
# Per method and budget: which of the four tasks it answers correctly (the same on both
# splits, but clones miss task 3 out of distribution at 1024).
CORRECT = {
    "clones": {256: [1, 1, 0, 0], 1024: [1, 1, 1, 1]},
    "sc@4": {256: [1, 0, 0, 0], 1024: [1, 1, 0, 0]},
    "monolithic": {256: [0, 0, 0, 0], 1024: [1, 0, 0, 0]},
    "clones (SFT start)": {256: [0, 0, 0, 0], 1024: [0, 0, 0, 0]},
    "monolithic (SFT start)": {256: [0, 0, 0, 0], 1024: [0, 0, 0, 0]},
}
# Per method: its total and critical-path tokens as fractions of the budget.
COST = {"clones": (0.5, 0.25), "sc@4": (0.9, 0.1), "monolithic": (0.6, 0.6),
        "clones (SFT start)": (0.5, 0.25), "monolithic (SFT start)": (0.6, 0.6)}
HELDOUT = {
    "clones": {"reward": 0.512, "start": 0.4, "difference": 0.112, "low": 0.05, "high": 0.17,
               "accuracy": 0.61, "start_accuracy": 0.5},
    "monolithic": {"reward": 0.3, "start": 0.32, "difference": -0.02, "low": -0.08, "high": 0.04,
                   "accuracy": 0.4, "start_accuracy": 0.42},
}
TIMINGS = {"warm start (SFT)": 79.4, "GRPO, clones": 60.6, "GRPO, monolithic": 40.2, "total": 250.0}
HISTORY = [{"reward/mean": 0.1, "accuracy": 0.2}, {"reward/mean": 0.3, "accuracy": 0.4}]


def correct(method: str, budget: int, split: str) -> list[int]:
    hits = list(CORRECT[method][budget])
    if (method, budget, split) == ("clones", 1024, "out-of-distribution"):
        hits[3] = 0
    return hits


def trees(method: str, hits: list[int]) -> list[CloneTree]:
    """One single-node tree per task; model text with markup, which the page must escape.

    sc@4 draws 4 samples a task, as evaluation saves them: the first is the one its vote
    elected (right where ``hits`` says), the last is wrong where the vote is right and right
    where it is wrong, so a report that read any sample but the elected one would be off."""
    made = []
    samples = 4 if method.startswith("sc@") else 1
    for i, hit in enumerate(hits):
        for k in range(samples):
            right = bool(hit) != (samples > 1 and k == samples - 1)  # the last sample disagrees
            info = {"method": method}
            if samples > 1:
                info["vote"] = {"answer": "7", "count": 3, "samples": samples, "elected": k == 0}
            tree = CloneTree(task_id=f"t{i}", task_index=i, sample_index=k, reward=float(right),
                             correct=right, info=info)
            tree.add(Node("0", None, 0, None, [1, 2],
                          segments=[Segment("sampled", [3, 4, 5], [-0.1] * 3,
                                            "Answer: <b>{{ 7*7 }}</b>")],
                          finish_reason="eos", answer="{{ 7*7 }}"))
            made.append(tree)
    return made


def cell(out, method: str, budget: int, split: str) -> CellResult:
    hits = correct(method, budget, split)
    name = f"trees/{method.replace(' ', '_')}-{budget}-{split}.jsonl"
    (out / name).write_text("".join(t.to_json() + "\n" for t in trees(method, hits)))
    accuracy = sum(hits) / len(hits)
    total, critical = (budget * share for share in COST[method])
    return CellResult(
        method=method, kind="clones", samples=1, budget=budget, split=split, tasks=TASKS,
        trees=TASKS,
        accuracy=Estimate(accuracy, max(0.0, accuracy - 0.25), min(1.0, accuracy + 0.25)),
        total_tokens=Estimate(total, total - 1, total + 1),
        critical_path_tokens=Estimate(critical, critical - 1, critical + 1),
        clones=1.0, spawn_error_rate=0.0, budget_truncated_rate=0.0, error_rate=0.0,
        reward=accuracy, trees_file=name)


def render(out, config) -> str:
    """report.md of the fixed evaluation under ``config``, written into ``out``."""
    (out / "eval" / "trees").mkdir(parents=True)
    results = EvalResults(
        cells=[cell(out / "eval", m, b, s) for m in CORRECT for b in BUDGETS for s in SPLITS],
        splits={split: TASKS for split in SPLITS}, methods=list(CORRECT), budgets=list(BUDGETS),
        settings={"bootstrap_samples": 200, "seed": 0})
    (out / "eval" / "results.md").write_text(markdown_report(results))
    settings = EvaluationConfig(budgets=list(BUDGETS), tasks_per_split=TASKS, reward_samples=2)
    path = write_repro_report(out, config, monolithic_twin(config), settings, results, HELDOUT,
                              HISTORY, HISTORY, TIMINGS)
    assert path == out / "report.md"
    return path.read_text()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("repro")
    return render(out, compose("cpu_repro_quick", [f"trainer.output_dir={out}"])), out


def section(text: str, title: str) -> str:
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def test_report_has_every_section_in_order(report):
    text, _ = report
    assert text.startswith("# CPU reproduction: cpu_repro_quick\n\nDoes a small model trained end "
                           "to end")
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert titles == ["## Setup", "## Machine", "## Wall time", "## Findings", "## Evidence",
                      "## Full evaluation",
                      # results.md, its title dropped
                      "## Accuracy and cost", "## Diagnostics", "## Frontier dominance"]
    assert text.endswith("\n")


def test_the_machine_is_named(report):
    """A long warm start is another draw on another CPU's rounding: the report says whose."""
    line = section(report[0], "Machine").strip().splitlines()[0]
    assert f"torch {torch.__version__} on {torch.backends.cpu.get_cpu_capability()} kernels" in line
    assert "thread(s)" in line and "commit " in line


def test_setup_states_model_task_budgets_and_training(report):
    setup = section(report[0], "Setup")
    assert ("- Model: `mini` Qwen2 built locally, random init (seed 0); tokenizer trained in "
            "memory.") in setup
    assert "- Task: `keyed_sum` {" in setup and "the clone arm's root sees the keys only" in setup
    assert ("- Per-node budgets (both arms): generation 128, context 192 tokens; training tree "
            "budget 1024 tokens.") in setup
    assert "- GRPO, each arm: 16 steps × " in setup
    assert ("- Evaluation: budgets [256, 1024] total generated tokens per task, 4 held-out tasks "
            "per split, greedy decoding") in setup


def test_setup_of_a_pretrained_model_on_another_task(tmp_path):
    """The other branch of each setup line; a sweep without the training budget is read at
    its largest budget."""
    config = compose("cpu_repro_quick", ["model.name=org/pretrained", "task.name=arithmetic",
                                         "rollout.budget.tree_generation=700"])
    config.task.eval_params, config.task.ood_params = {"digits": [2, 3]}, {"digits": [4]}
    text = render(tmp_path, config)
    assert "- Model: `org/pretrained` (pretrained), protocol `token`." in text
    assert ("; both arms see the same prompts. In distribution: {\"digits\": [2, 3]}; "
            "OOD: {\"digits\": [4]}.") in text
    assert "training tree budget 700 tokens." in text
    assert "Greedy accuracy at the training budget (1024 tokens)" in text


def test_wall_time_and_held_out_reward_tables(report):
    text = report[0]
    assert ("| phase | seconds |\n| --- | --- |\n| warm start (SFT) | 79 |\n"
            "| GRPO, clones | 61 |\n") in text
    assert "| total | 250 |" in text
    findings = section(text, "Findings")
    assert "2 samples per task, 4 in-distribution tasks never trained on" in findings
    assert ("| clones | 0.512 | 0.400 | +0.112 [+0.050, +0.170] | 0.61 | 0.50 | gains |"
            in findings)
    assert ("| monolithic | 0.300 | 0.320 | -0.020 [-0.080, +0.040] | 0.40 | 0.42 | no resolved "
            "change: -0.020 is within the interval's half-width 0.060 (the SFT start left 0.58 of "
            "accuracy to gain) |") in findings


def test_accuracy_against_the_sft_start_and_frontiers(report):
    findings = section(report[0], "Findings")
    assert "Greedy accuracy at the training budget (1024 tokens)" in findings
    # Every task gained: the paired interval collapses onto the difference.
    assert "| clones | in-distribution | 1.00 | 0.00 | +1.00 [+1.00, +1.00] | gains |" in findings
    assert "| monolithic | out-of-distribution | 0.25 | 0.00 | +0.25 [" in findings
    # sc@4 at 256 costs 26 critical-path tokens, less than any clone point: not covered.
    assert "| clones | monolithic | in-distribution | yes | yes |" in findings
    assert "| clones | sc@4 | out-of-distribution | yes | no |" in findings
    assert ("| split | budget | clones | monolithic | sc@4 | clones − monolithic "
            "| clones − sc@4 |") in findings
    assert "| in-distribution | 256 | 0.50 | 0.00 | 0.25 | +0.50 [" in findings
    # The lead over sc@4 compares with its vote (the elected sample): clones [1, 1, 0, 0]
    # against the vote's [1, 0, 0, 0] at 256, and [1, 1, 1, 0] against [1, 1, 0, 0] at 1024.
    assert ("| in-distribution | 256 | 0.50 | 0.00 | 0.25 | +0.50 [+0.00, +1.00] | +0.25 [+0.00, "
            "+0.75] |") in findings
    assert ("| out-of-distribution | 1024 | 0.75 | 0.25 | 0.50 | +0.50 [+0.00, +1.00] | +0.25 "
            "[+0.00, +0.75] |") in findings
    assert ("- out-of-distribution, clones: accuracy 0.75 [0.50, 1.00], 512 tokens, critical path "
            "256") in findings


def test_example_trees_evidence_and_full_evaluation(report):
    text, out = report
    assert "Example clone-arm tree (out-of-distribution, budget 1024):\n\n```\ntree t0#0" in text
    assert "sampled: 'Answer: <b>{{ 7*7 }}</b>'" in text  # Markdown is text: nothing escaped
    evidence = section(text, "Evidence")
    assert "[training_curves.png](training_curves.png)" in evidence
    assert "![Pareto, total tokens](eval/pareto_total_tokens.png)" in evidence
    full = text.split("\n## Full evaluation\n\nBudgets (total generated tokens per task): 256, "
                      "1024.", 1)[1]
    assert "# Evaluation" not in full and "| method | budget |" in full
    assert (out / "training_curves.png").stat().st_size > 0
    page = (out / "eval" / "trace.html").read_text()
    assert page.count("<details class=\"tree\"") == 2 * TASKS  # the first five of each split
    assert "{{ 7*7 }}" in page and ">49<" not in page and "<b>" not in page


def test_every_rl_arm_is_said_to_gain_lose_or_not_and_why():
    assert rl_verdict(0.05, 0.01, 0.09, 0.4) == "gains"
    assert rl_verdict(-0.05, -0.09, -0.01, 0.4) == "loses"
    assert rl_verdict(0.0, 0.0, 0.0, 0.0) == (
        "no change: every task scored the same before and after RL")
    assert rl_verdict(0.01, -0.03, 0.05, 0.98) == (
        "no resolved change: +0.010 is within the interval's half-width 0.040 (the SFT start "
        "left 0.02 of accuracy to gain)")
