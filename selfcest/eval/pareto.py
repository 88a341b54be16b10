"""Accuracy-cost Pareto frontiers: which points are non-dominated, whether one method's
frontier dominates another's, and the plots that show them.

A point is better when it is more accurate and cheaper. ``p`` *weakly dominates* ``q`` when
``p.accuracy >= q.accuracy`` and ``p.cost <= q.cost``; it *strictly dominates* ``q`` when,
in addition, one of the two inequalities is strict. The *frontier* of a set of points is the
set of points that no point of the set strictly dominates (identical points are all kept).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from selfcest.eval.results import COST_METRICS, CellResult, CostMetric, EvalResults
from selfcest.eval.stats import Estimate

COST_LABELS = {
    "total_tokens": "mean generated tokens per task",
    "critical_path_tokens": "mean critical-path tokens per task",
}


@dataclass(frozen=True)
class ParetoPoint:
    """One method at one budget, placed in the accuracy-cost plane."""

    cost: float  # tokens (lower is better)
    accuracy: float  # fraction correct (higher is better)
    label: str = ""  # e.g. "clones @ 512", for messages and plots


def weakly_dominates(p: ParetoPoint, q: ParetoPoint) -> bool:
    return p.accuracy >= q.accuracy and p.cost <= q.cost


def strictly_dominates(p: ParetoPoint, q: ParetoPoint) -> bool:
    return weakly_dominates(p, q) and (p.accuracy > q.accuracy or p.cost < q.cost)


def pareto_frontier(points: Iterable[ParetoPoint]) -> list[ParetoPoint]:
    """The non-dominated points, by increasing cost (then decreasing accuracy)."""
    points = list(points)
    frontier = [p for p in points if not any(strictly_dominates(q, p) for q in points)]
    return sorted(frontier, key=lambda p: (p.cost, -p.accuracy))


def frontier_dominates(a: Sequence[ParetoPoint], b: Sequence[ParetoPoint]) -> bool:
    """Whether the frontier of ``a`` dominates the frontier of ``b``.

    True when every point of ``b``'s frontier is weakly dominated by some point of ``a``
    (as accurate or more, at the same cost or less) and at least one point of ``b``'s
    frontier is strictly dominated by a point of ``a``. Comparing frontiers, not raw points,
    keeps a method's own dominated points (say, an oversized budget) from counting as a win
    for the other. Points of ``a`` outside ``b``'s cost range neither help nor hurt; an empty
    ``b`` is never dominated.
    """
    front_a, front_b = pareto_frontier(a), pareto_frontier(b)
    if not front_b:
        return False
    covered = all(any(weakly_dominates(p, q) for p in front_a) for q in front_b)
    beaten = any(strictly_dominates(p, q) for p in front_a for q in front_b)
    return covered and beaten


def method_points(
    results: EvalResults, method: str, split: str, cost: CostMetric = "total_tokens"
) -> list[ParetoPoint]:
    """One point per budget of ``method`` on ``split``: (mean cost, accuracy)."""
    return [_point(cell, cost) for cell in results.select(method=method, split=split)]


def compare_frontiers(
    results: EvalResults, a: str, b: str, cost: CostMetric = "total_tokens"
) -> dict[str, bool]:
    """Per split, whether method ``a``'s frontier dominates method ``b``'s (see
    `frontier_dominates`), on point estimates of accuracy and ``cost``."""
    for name in (a, b):
        if name not in results.methods:
            raise KeyError(f"no method {name!r} in the results (have {results.methods})")
    return {
        split: frontier_dominates(
            method_points(results, a, split, cost), method_points(results, b, split, cost)
        )
        for split in results.splits
    }


def _point(cell: CellResult, cost: CostMetric) -> ParetoPoint:
    return ParetoPoint(cell.cost(cost).value, cell.accuracy.value, f"{cell.method} @ {cell.budget}")


# ---------------------------------------------------------------------------- plots


def plot_pareto(results: EvalResults, cost: CostMetric, path: str | Path) -> Path:
    """Accuracy against ``cost``: a panel per split, a series per method (its budgets joined
    in cost order, 95% intervals as error bars on both axes, budgets annotated), and the
    frontier across all methods ringed and drawn as a staircase. Saved as PNG."""
    if cost not in COST_METRICS:
        raise ValueError(f"cost must be one of {COST_METRICS}, got {cost!r}")
    splits = list(results.splits)
    # A bare Figure on the Agg canvas, not pyplot: no display needed, and no global backend
    # switched under a notebook that imports this.
    fig = Figure(figsize=(5.5 * len(splits), 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(splits), squeeze=False)
    for ax, split in zip(axes[0], splits):
        everything = []
        for method in results.methods:
            cells = sorted(results.select(method=method, split=split),
                           key=lambda c: c.cost(cost).value)
            if not cells:
                continue
            x = [c.cost(cost).value for c in cells]
            y = [c.accuracy.value for c in cells]
            xerr = _error_bars([c.cost(cost) for c in cells])
            yerr = _error_bars([c.accuracy for c in cells])
            ax.errorbar(x, y, xerr=xerr, yerr=yerr, marker="o", capsize=3, label=method)
            for c, xi, yi in zip(cells, x, y):
                ax.annotate(str(c.budget), (xi, yi), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color="dimgray")
            everything.extend(_point(c, cost) for c in cells)
        frontier = pareto_frontier(everything)
        if frontier:
            ax.step([p.cost for p in frontier], [p.accuracy for p in frontier], where="post",
                    color="black", linestyle="--", linewidth=1, label="Pareto frontier")
            ax.scatter([p.cost for p in frontier], [p.accuracy for p in frontier], s=160,
                       facecolors="none", edgecolors="black", linewidths=1.5, zorder=3)
        costs = [p.cost for p in everything]
        # Budget sweeps are usually geometric: a log axis spaces them evenly.
        if costs and min(costs) > 0 and max(costs) / min(costs) >= 4:
            ax.set_xscale("log")
        ax.set_title(f"{split} ({results.splits[split]} tasks)")
        ax.set_xlabel(COST_LABELS[cost])
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def _error_bars(estimates: list[Estimate]) -> list[list[float]]:
    """Distances from each value down to its low and up to its high bound. A percentile
    interval need not contain the mean (rarely, on skewed data): such a side gets no bar."""
    return [[max(0.0, e.value - e.low) for e in estimates],
            [max(0.0, e.high - e.value) for e in estimates]]
