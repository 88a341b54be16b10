"""``report.md`` of the CPU reproduction: what was run, what was found, and the evidence.

The verdicts are computed from the evaluation, never written by hand: frontier dominance
per split and cost metric, and each arm's held-out change over its SFT start with
bootstrap intervals of the difference (paired over tasks). This module computes every
figure and verdict; the wording and layout are the template
``selfcest/templates/repro_report.md.j2``.
"""

from __future__ import annotations

import json
from pathlib import Path

from selfcest import machine
from selfcest.eval.evaluate import task_correctness
from selfcest.eval.pareto import compare_frontiers
from selfcest.eval.results import EvalResults
from selfcest.eval.stats import bootstrap_mean
from selfcest.eval.view import read_trees, render_html
from selfcest.policy import SIZES
from selfcest.tasks import TASKS
from selfcest.templates import environment
from selfcest.train.config import TrainConfig

CLONES, MONO = "clones", "monolithic"
CLONES_SFT, MONO_SFT = "clones (SFT start)", "monolithic (SFT start)"

_ENVIRONMENT = environment(html=False)  # Markdown: text, nothing escaped
_ENVIRONMENT.filters["json"] = json.dumps


def paired_difference(results: EvalResults, out: Path, a: str, b: str, budget: int, split: str,
                      resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean per-task accuracy difference a − b and its 95% percentile-bootstrap interval
    (tasks resampled jointly, since both methods saw the same tasks)."""
    def correct(method: str) -> dict[str, float]:
        cell = results.cell(method, budget, split)
        return task_correctness(read_trees(out / cell.trees_file))

    left, right = correct(a), correct(b)
    paired = bootstrap_mean([left[task] - right[task] for task in sorted(left)], resamples,
                            seed=seed)
    return paired.value, paired.low, paired.high


def training_curves(histories: dict[str, list[dict]], path: Path) -> Path:
    """Reward and accuracy per training step of each arm (PNG)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6))
    for axis, key, label in zip(figure.subplots(1, 2), ("reward/mean", "accuracy"),
                                ("mean reward (shaped)", "accuracy of sampled trees")):
        for name, history in histories.items():
            axis.plot(range(1, len(history) + 1), [h[key] for h in history], marker="o",
                      markersize=3, label=name)
        axis.set_xlabel("training step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def write_repro_report(out: Path, config: TrainConfig, twin: TrainConfig, settings,
                       results: EvalResults,
                       heldout: dict[str, dict[str, float]], clones_history: list[dict],
                       mono_history: list[dict], timings: dict[str, float],
                       warm_start: dict[str, dict] | None = None) -> Path:
    """``report.md`` (the template ``repro_report.md.j2``), with the training curves and a
    trace page of example clone-arm trees (``eval/trace.html``) beside it.

    Findings are read at the training tree budget, or at the largest evaluated budget when
    the sweep does not include it."""
    eval_dir = out / "eval"
    training_budget = config.rollout.budget.tree_generation
    budget = training_budget if training_budget in results.budgets else max(results.budgets)
    curves = training_curves({"clones (A)": clones_history, "monolithic (B)": mono_history},
                             out / "training_curves.png")
    sc = f"sc@{settings.sc_samples}"
    text = _ENVIRONMENT.get_template("repro_report.md.j2").render(
        config=config, twin=twin, settings=settings, results=results, heldout=heldout,
        timings=timings, warm_start=warm_start or {}, training_budget=training_budget,
        budget=budget, sc=sc,
        built_locally=config.model.name in SIZES, curves=curves.name,
        clone_view=TASKS[config.task.name].clone_view,
        against_start=_against_start(results, eval_dir, budget),
        dominance=_dominance(results, sc), leads=_leads(results, eval_dir, sc),
        examples=_examples(config, results, eval_dir, budget),
        verdict=rl_verdict, machine=machine.one_line(machine.describe()),
        evaluation=(eval_dir / "results.md").read_text().replace("# Evaluation", "", 1).strip(),
    )
    report = out / "report.md"
    report.write_text(text)
    return report


def rl_verdict(value: float, low: float, high: float, start_accuracy: float) -> str:
    """What RL did to a measure, said plainly: it gains or loses when the interval is clear
    of 0; otherwise no change is resolved, and why: the change lies within the interval's
    half-width, and the start left only so much accuracy to gain."""
    if low > 0:
        return "gains"
    if high < 0:
        return "loses"
    if low == high:
        return "no change: every task scored the same before and after RL"
    half_width = (high - low) / 2
    return (f"no resolved change: {value:+.3f} is within the interval's half-width "
            f"{half_width:.3f} "
            f"(the SFT start left {1 - start_accuracy:.2f} of accuracy to gain)")


def _against_start(results: EvalResults, eval_dir: Path, budget: int) -> list[tuple]:
    """Per arm and split: accuracy after RL, at the SFT start, and the paired difference."""
    return [(arm, split, results.cell(arm, budget, split).accuracy.value,
             results.cell(start, budget, split).accuracy.value,
             paired_difference(results, eval_dir, arm, start, budget, split))
            for arm, start in ((CLONES, CLONES_SFT), (MONO, MONO_SFT)) for split in results.splits]


def _dominance(results: EvalResults, sc: str) -> list[tuple[str, str, bool, bool]]:
    """Whether the clone arm's frontier dominates each baseline's, per split, on total and
    on critical-path tokens."""
    rows = []
    for other in (MONO, sc):
        total = compare_frontiers(results, CLONES, other, "total_tokens")
        critical = compare_frontiers(results, CLONES, other, "critical_path_tokens")
        rows += [(other, split, total[split], critical[split]) for split in results.splits]
    return rows


def _leads(results: EvalResults, eval_dir: Path, sc: str) -> list[tuple]:
    """Per split and budget: the three methods' accuracies and the clone arm's paired lead
    over each baseline."""
    return [(split, each,
             *(results.cell(m, each, split).accuracy.value for m in (CLONES, MONO, sc)),
             *(paired_difference(results, eval_dir, CLONES, other, each, split)
               for other in (MONO, sc)))
            for split in results.splits for each in results.budgets]


def _examples(config: TrainConfig, results: EvalResults, eval_dir: Path,
              budget: int) -> list[tuple[str, str]]:
    """The first clone-arm tree of each split as text, for the report; the first five of each
    go to ``eval/trace.html``."""
    examples, shown = [], []
    for split in results.splits:
        trees = read_trees(eval_dir / results.cell(CLONES, budget, split).trees_file)
        examples.append((split, trees[0].pretty(160)))
        shown += trees[:5]
    (eval_dir / "trace.html").write_text(render_html(shown,
                                                     title=f"{config.name}: clone-arm trees"))
    return examples
