"""Writes an evaluation's files: ``results.json``, ``results.csv``, ``results.md`` (splits
side by side) and the two Pareto plots."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from selfcest.eval.pareto import compare_frontiers, plot_pareto
from selfcest.eval.results import COST_METRICS, CellResult, EvalResults
from selfcest.eval.stats import Estimate

PLOT_FILES = {
    "total_tokens": "pareto_total_tokens.png",
    "critical_path_tokens": "pareto_critical_path.png",
}
CSV_COLUMNS = (
    "method", "kind", "samples", "budget", "split", "tasks", "trees",
    "accuracy", "accuracy_low", "accuracy_high",
    "total_tokens", "total_tokens_low", "total_tokens_high",
    "critical_path_tokens", "critical_path_tokens_low", "critical_path_tokens_high",
    "clones", "spawn_error_rate", "budget_truncated_rate", "error_rate", "reward", "trees_file",
)


@dataclass
class ReportFiles:
    """Where `write_report` put each file."""

    json: Path  # every cell and the settings; `EvalResults.load` reads it back
    csv: Path  # one row per method × budget × split
    markdown: Path  # tables with the splits side by side, and frontier dominance
    plots: dict[str, Path]  # cost metric -> Pareto plot (PNG)


def write_report(results: EvalResults, out_dir: str | Path) -> ReportFiles:
    """Write every report file of ``results`` into ``out_dir`` (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = out / "results.md"
    markdown.write_text(markdown_report(results))
    return ReportFiles(
        json=results.save(out / "results.json"),
        csv=write_csv(results, out / "results.csv"),
        markdown=markdown,
        plots={cost: plot_pareto(results, cost, out / name) for cost, name in PLOT_FILES.items()},
    )


def write_csv(results: EvalResults, path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for cell in results.cells:
            writer.writerow(_csv_row(cell))
    return path


def _csv_row(cell: CellResult) -> dict[str, object]:
    """The cell flattened: each estimate becomes value, _low and _high columns. (DictWriter
    refuses keys outside CSV_COLUMNS, so a field added to CellResult cannot go missing.)"""
    row = cell.to_dict()
    for name in ("accuracy", *COST_METRICS):
        estimate = row.pop(name)
        row[name], row[f"{name}_low"], row[f"{name}_high"] = (
            estimate["value"], estimate["low"], estimate["high"])
    return row


def markdown_report(results: EvalResults) -> str:
    """The evaluation as Markdown: settings, a main table and a diagnostics table with one
    column group per split (in-distribution and OOD side by side), and frontier dominance."""
    settings = results.settings
    splits = list(results.splits)
    split_list = ", ".join(f"{name} ({n} tasks)" for name, n in results.splits.items())
    lines = [
        "# Evaluation",
        "",
        f"Budgets (total generated tokens per task): {', '.join(map(str, results.budgets))}. "
        f"Splits: {split_list}.",
        "",
        "Means over tasks; brackets: "
        f"{settings.get('confidence_level', 0.95):.0%} percentile-bootstrap intervals over tasks "
        f"({settings.get('bootstrap_samples', '?')} resamples, seed {settings.get('seed', '?')}). "
        "Self-consistency votes over k samples of budget // k tokens each: its tokens are summed "
        "over the samples, its critical path is the longest sample's.",
        "",
        "## Accuracy and cost",
        "",
    ]
    main = ("accuracy", "tokens", "critical path", "clones")
    lines += _table(results, splits, main, lambda c: [
        _estimate(c.accuracy, 3), _estimate(c.total_tokens, 1),
        _estimate(c.critical_path_tokens, 1), f"{c.clones:.2f}",
    ])
    lines += ["", "## Diagnostics", "",
              "Rates are fractions of trees: with a spawn error entry, whose root stopped on a "
              "budget, whose root failed.", ""]
    diagnostics = ("reward", "spawn errors", "truncated", "errors")
    lines += _table(results, splits, diagnostics, lambda c: [
        f"{c.reward:.3f}", f"{c.spawn_error_rate:.2f}", f"{c.budget_truncated_rate:.2f}",
        f"{c.error_rate:.2f}",
    ])
    if len(results.methods) > 1:
        lines += ["", "## Frontier dominance", "",
                  "Does A's accuracy-cost frontier dominate B's (point estimates; every point of "
                  "B's frontier matched or beaten by A, at least one beaten)? Per split: on total "
                  "tokens / on critical-path tokens.", ""]
        lines += _dominance_table(results, splits)
    return "\n".join(lines) + "\n"


def _table(results: EvalResults, splits: list[str], columns: tuple[str, ...], values) -> list[str]:
    header = ["method", "budget"] + [f"{split} {column}" for split in splits for column in columns]
    rows = [_row(header), _row(["---"] * len(header))]
    for method in results.methods:
        for budget in results.budgets:
            row = [_cell_text(method), str(budget)]
            for split in splits:
                row += values(results.cell(method, budget, split))
            rows.append(_row(row))
    return rows


def _dominance_table(results: EvalResults, splits: list[str]) -> list[str]:
    rows = [_row(["A", "B", *splits]), _row(["---"] * (2 + len(splits)))]
    for a in results.methods:
        for b in results.methods:
            if a == b:
                continue
            verdicts = {cost: compare_frontiers(results, a, b, cost) for cost in COST_METRICS}
            cells = [
                " / ".join("yes" if verdicts[cost][split] else "no" for cost in COST_METRICS)
                for split in splits
            ]
            rows.append(_row([_cell_text(a), _cell_text(b), *cells]))
    return rows


def _estimate(estimate: Estimate, digits: int) -> str:
    return f"{estimate.value:.{digits}f} [{estimate.low:.{digits}f}, {estimate.high:.{digits}f}]"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
