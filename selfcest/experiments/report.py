"""``report.md`` of the CPU reproduction: what was run, what was found, and the evidence.

The verdicts are computed from the evaluation, never written by hand: frontier dominance
per split and cost metric, and each arm's held-out change over its SFT start with
bootstrap intervals of the difference (paired over tasks).
"""

from __future__ import annotations

import json
from pathlib import Path

from selfcest.eval.pareto import compare_frontiers
from selfcest.eval.results import CellResult, EvalResults
from selfcest.eval.stats import bootstrap_mean
from selfcest.eval.view import read_trees, render_html
from selfcest.policy import SIZES
from selfcest.train.config import TrainConfig

CLONES, MONO, CLONES_SFT, MONO_SFT = "clones", "monolithic", "clones (SFT start)", "monolithic (SFT start)"


def paired_difference(results: EvalResults, out: Path, a: str, b: str, budget: int, split: str,
                      resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean per-task accuracy difference a − b and its 95% percentile-bootstrap interval
    (tasks resampled jointly, since both methods saw the same tasks)."""
    def correct(method: str) -> dict[str, float]:
        cell = results.cell(method, budget, split)
        return {t.task_id: float(bool(t.correct)) for t in read_trees(out / cell.trees_file)}

    left, right = correct(a), correct(b)
    paired = bootstrap_mean([left[task] - right[task] for task in sorted(left)], resamples, seed=seed)
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


def _fmt_cell(cell: CellResult) -> str:
    acc = cell.accuracy
    return (f"accuracy {acc.value:.2f} [{acc.low:.2f}, {acc.high:.2f}], "
            f"{cell.total_tokens.value:.0f} tokens, critical path {cell.critical_path_tokens.value:.0f}")


def _model_line(config: TrainConfig) -> str:
    if config.model.name in SIZES:
        return (f"- Model: `{config.model.name}` Qwen2 built locally, random init "
                f"(seed {config.model.init_seed}); tokenizer trained in memory.")
    return f"- Model: `{config.model.name}` (pretrained), protocol `{config.model.protocol}`."


def _task_line(config: TrainConfig) -> str:
    task = config.task
    if task.name == "keyed_sum":
        return (f"- Task: `keyed_sum` {json.dumps(task.params.get('train'))}; the clone arm's root "
                f"sees keys only, the monolithic arm reads the lists inline. OOD: "
                f"{json.dumps(task.params.get('ood'))}.")
    return (f"- Task: `{task.name}` {json.dumps(task.params)}; both arms see the same prompts. "
            f"In distribution: {json.dumps(task.eval_params)}; OOD: {json.dumps(task.ood_params)}.")


def write_repro_report(out: Path, config: TrainConfig, twin: TrainConfig, settings, results: EvalResults,
                       heldout: dict[str, dict[str, float]], clones_history: list[dict],
                       mono_history: list[dict], timings: dict[str, float]) -> Path:
    eval_dir = out / "eval"
    splits = list(results.splits)
    training_budget = config.rollout.budget.tree_generation
    budget = training_budget if training_budget in results.budgets else max(results.budgets)
    curves = training_curves({"clones (A)": clones_history, "monolithic (B)": mono_history},
                             out / "training_curves.png")

    lines = [
        f"# CPU reproduction: {config.name}",
        "",
        "Does a small model trained end to end with clones beat its monolithic twin on the "
        "accuracy-cost Pareto frontier at matched total-token budgets, in distribution and out "
        "of distribution? Everything below is computed by `selfcest/experiments/cpu_repro.py` "
        "from this run.",
        "",
        "## Setup",
        "",
        _model_line(config),
        _task_line(config),
        f"- Per-node budgets (both arms): generation {config.rollout.budget.node_generation}, "
        f"context {config.rollout.budget.node_context} tokens; training tree budget "
        f"{training_budget} tokens.",
        f"- Warm start (shared): {config.warm_start.sft.steps} SFT steps on teacher "
        f"demonstrations of both styles ({json.dumps(config.warm_start.teacher_params)}).",
        f"- GRPO, each arm: {config.trainer.steps} steps × {config.trainer.prompts_per_step} "
        f"prompts × {config.trainer.trees_per_prompt} trees, lr {config.trainer.lr}; "
        f"reward `{config.task.reward}` {json.dumps(config.task.reward_params)} (monolithic: "
        f"{json.dumps(twin.task.reward_params)}).",
        f"- Evaluation: budgets {list(results.budgets)} total generated tokens per task, "
        f"{settings.tasks_per_split} held-out tasks per split, greedy decoding "
        f"(self-consistency samples at temperature 1); 95% bootstrap intervals.",
        "",
        "## Wall time",
        "",
        "| phase | seconds |",
        "| --- | --- |",
        *[f"| {phase} | {seconds:.0f} |" for phase, seconds in timings.items()],
        "",
        "## Findings",
        "",
        f"Held-out reward as RL optimises it (training temperature "
        f"{config.rollout.temperature}, training budget, {settings.reward_samples} samples per "
        f"task, {settings.tasks_per_split} in-distribution tasks never trained on), after RL "
        "against the arm's own SFT start, paired over tasks:",
        "",
        "| arm | reward after RL | SFT start | difference [95% CI] | accuracy after RL | SFT start |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {arm} | {h['reward']:.3f} | {h['start']:.3f} | {h['difference']:+.3f} "
          f"[{h['low']:+.3f}, {h['high']:+.3f}] | {h['accuracy']:.2f} | {h['start_accuracy']:.2f} |"
          for arm, h in heldout.items()],
        "",
        f"Greedy accuracy at the training budget ({budget} tokens) against the SFT start, "
        "paired over the same tasks:",
        "",
        "| arm | split | after RL | SFT start | difference [95% CI] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, start in ((CLONES, CLONES_SFT), (MONO, MONO_SFT)):
        for split in splits:
            diff, low, high = paired_difference(results, eval_dir, arm, start, budget, split)
            lines.append(
                f"| {arm} | {split} | {results.cell(arm, budget, split).accuracy.value:.2f} | "
                f"{results.cell(start, budget, split).accuracy.value:.2f} | "
                f"{diff:+.2f} [{low:+.2f}, {high:+.2f}] |")
    lines += ["", "Frontier dominance (accuracy against cost; see the Pareto plots):", "",
              "| A | B | split | on total tokens | on critical-path tokens |",
              "| --- | --- | --- | --- | --- |"]
    for other in (MONO, f"sc@{settings.sc_samples}"):
        total = compare_frontiers(results, CLONES, other, "total_tokens")
        critical = compare_frontiers(results, CLONES, other, "critical_path_tokens")
        for split in splits:
            lines.append(f"| clones | {other} | {split} | {'yes' if total[split] else 'no'} | "
                         f"{'yes' if critical[split] else 'no'} |")
    sc = f"sc@{settings.sc_samples}"
    lines += ["", "Accuracy at each matched total-token budget, and the clone arm's lead over each "
              "baseline (paired over tasks, 95% CI):", "",
              f"| split | budget | clones | monolithic | {sc} | clones − monolithic | clones − {sc} |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for split in splits:
        for each in results.budgets:
            leads = [paired_difference(results, eval_dir, CLONES, other, each, split) for other in (MONO, sc)]
            accuracy = [results.cell(m, each, split).accuracy.value for m in (CLONES, MONO, sc)]
            lines.append(f"| {split} | {each} | " + " | ".join(f"{a:.2f}" for a in accuracy) + " | "
                         + " | ".join(f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]" for d, lo, hi in leads) + " |")
    lines += ["", "At the training budget:", ""]
    for split in splits:
        for method in results.methods:
            lines.append(f"- {split}, {method}: {_fmt_cell(results.cell(method, budget, split))}")

    html = eval_dir / "trace.html"
    examples = []
    for split in splits:
        cell = results.cell(CLONES, budget, split)
        trees = read_trees(eval_dir / cell.trees_file)
        examples += trees[:5]
        lines += ["", f"Example clone-arm tree ({split}, budget {budget}):", "", "```",
                  trees[0].pretty(160), "```"]
    html.write_text(render_html(examples, title=f"{config.name}: clone-arm trees"))
    lines += [
        "",
        "## Evidence",
        "",
        "- Pareto plots: [total tokens](eval/pareto_total_tokens.png), "
        "[critical path](eval/pareto_critical_path.png)",
        f"- Training curves: [{curves.name}]({curves.name}); metrics in "
        "`clones/metrics.jsonl`, `monolithic/metrics.jsonl`, `sft/sft.jsonl`",
        "- Every evaluated tree: `eval/trees/*.jsonl` (`selfcest-view FILE -o page.html`); "
        "a sample: [eval/trace.html](eval/trace.html)",
        "",
        "![Pareto, total tokens](eval/pareto_total_tokens.png)",
        "![Pareto, critical path](eval/pareto_critical_path.png)",
        f"![Training curves]({curves.name})",
        "",
        "## Full evaluation",
        "",
        (eval_dir / "results.md").read_text().replace("# Evaluation", "", 1).strip(),
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
