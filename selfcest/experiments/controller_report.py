"""``report.md`` of one controller run and the plots beside it.

Every figure comes from the run's summary (`selfcest.experiments.controller.summarize`); the
wording and layout are the template ``selfcest/templates/controller_report.md.j2``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from matplotlib.figure import Figure

from selfcest import machine
from selfcest.experiments.report import training_curves
from selfcest.templates import environment
from selfcest.train.config import TrainConfig

_ENVIRONMENT = environment(html=False)
_ENVIRONMENT.filters["json"] = json.dumps


def plot_by_size(series: dict[str, list[tuple[int, dict | None]]], ylabel: str, path: Path) -> Path:
    """One line per label: an estimate (``{value, low, high}``, or None where there is
    none) against task size, with its interval as error bars (PNG)."""
    figure = Figure(figsize=(6, 3.6))
    axis = figure.subplots()
    for label, points in series.items():
        points = [(size, e) for size, e in points if e is not None]
        if not points:
            continue
        sizes = [size for size, _ in points]
        values = [e["value"] for _, e in points]
        errors = [[e["value"] - e["low"] for _, e in points],
                  [e["high"] - e["value"] for _, e in points]]
        axis.errorbar(sizes, values, yerr=errors, marker="o", markersize=4, capsize=3, label=label)
    axis.set_xlabel("task size (keys)")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    if axis.containers:  # a line was drawn
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def plot_training_rates(rates: dict, path: Path, window: int = 5) -> Path:
    """P(the root delegates) per size over training steps, a running mean over ``window``
    steps of the steps that drew that size (PNG)."""
    figure = Figure(figsize=(6, 3.6))
    axis = figure.subplots()
    for size, series in rates.items():
        points = [(step, rate) for step, rate in enumerate(series, 1) if rate is not None]
        smooth = [statistics.fmean(r for _, r in points[max(0, i - window + 1): i + 1])
                  for i in range(len(points))]
        axis.plot([step for step, _ in points], smooth, label=f"{size} keys")
    axis.set_xlabel("training step")
    axis.set_ylabel(f"P(root delegates), mean of {window}")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    if rates:
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def plot_decisions(records: list[dict], path: Path) -> Path:
    """P(the root delegates) against size: the warm start, and RL under each setting (means
    over its seeds, one line per setting and credit); a dotted line marks each setting's
    oracle crossing, the first size where the warm start's better style is delegation (PNG)."""
    figure = Figure(figsize=(6.4, 3.8))
    axis = figure.subplots()
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(_label(r), []).append(r)
    sizes = records[0]["sizes"] if records else []
    if records:
        start = [statistics.fmean(r["p_delegate"]["warm start"][i] for r in records)
                 for i in range(len(sizes))]
        axis.plot(sizes, start, color="gray", marker="o", markersize=4, label="warm start")
    for n, (label, runs) in enumerate(groups.items()):
        color = f"C{n}"
        rates = [statistics.fmean(r["p_delegate"]["RL"][i] for r in runs)
                 for i in range(len(sizes))]
        axis.plot(sizes, rates, color=color, marker="o", markersize=4, label=f"RL, {label}")
        crossing = next((s for s, o in zip(sizes, runs[0]["oracle"]) if o == "delegate"), None)
        if crossing is not None:
            axis.axvline(crossing - 0.5 + 0.04 * n, color=color, linestyle=":", linewidth=1)
    axis.set_xlabel("task size (keys); dotted: where the oracle turns to delegation")
    axis.set_ylabel("P(root delegates)")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    if records:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def _label(record: dict) -> str:
    cost = {"none": "no cost", "token": f"λ={record['lambda']:g}/token",
            "latency": f"λ={record['lambda']:g}/critical-path token"}[record["cost"]]
    return cost if record["credit"] == "broadcast" else f"{cost}, {record['credit']}"


def size_series(summary: dict, field: str) -> dict[str, list[tuple[int, dict | None]]]:
    """``field`` of every per-size row, one series per policy of the summary."""
    return {name: [(row["size"], row[field]) for row in rows] for name,
            rows in summary["per_size"].items()}


def write_controller_report(out: Path, config: TrainConfig, summary: dict,
                            history: list[dict]) -> Path:
    """``report.md`` with ``delegation_rate.png``, ``branching.png`` and ``training_curve.png``."""
    plots = {
        "rate": plot_by_size(size_series(summary, "delegation_rate"), "P(root delegates)",
                             out / "delegation_rate.png").name,
        "branching": plot_by_size(size_series(summary, "branching"), "clones of the first call",
                                  out / "branching.png").name,
        "curve": training_curves({"RL": history}, out / "training_curve.png").name,
        "training_rate": plot_training_rates(summary["training_rate"],
                                             out / "training_rate.png").name,
    }
    text = _ENVIRONMENT.get_template("controller_report.md.j2").render(
        config=config, summary=summary, plots=plots,
        machine=machine.one_line(summary["machine"]) if summary.get("machine") else "not recorded")
    report = out / "report.md"
    report.write_text(text)
    return report
