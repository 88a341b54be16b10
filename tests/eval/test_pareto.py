"""Pareto frontiers and frontier dominance on hand-made points and results; the report and
plots drawn from hand-made results."""

from __future__ import annotations

import csv

import pytest
from matplotlib.image import imread

from selfcest.eval import (
    CellResult,
    Estimate,
    EvalResults,
    ParetoPoint,
    compare_frontiers,
    frontier_dominates,
    method_points,
    pareto_frontier,
    plot_pareto,
    write_report,
)


def points(*pairs: tuple[float, float]) -> list[ParetoPoint]:
    return [ParetoPoint(cost, accuracy, f"p{i}") for i, (cost, accuracy) in enumerate(pairs)]


def test_frontier_keeps_exactly_the_non_dominated_points():
    a, b, c, d, e, f, g = points((10, .5), (20, .7), (15, .4), (20, .6), (30, .7), (10, .5),
                                 (5, .1))
    # c: worse and dearer than a; d: as dear as b, less accurate; e: as accurate as b, dearer.
    # f duplicates a (neither strictly dominates the other): both stay. g is cheapest: it stays.
    assert pareto_frontier([e, d, c, b, a, f, g]) == [g, a, f, b]
    assert pareto_frontier([]) == []


@pytest.mark.parametrize(
    "a, b, a_dominates_b",
    [
        # Better accuracy at every cost of B.
        ([(10, .6), (20, .8)], [(10, .5), (20, .7)], True),
        # Matches one point of B's frontier and beats the other.
        ([(10, .5), (20, .8)], [(10, .5), (20, .7)], True),
        # Same accuracy, cheaper.
        ([(8, .5)], [(10, .5)], True),
        # Identical frontiers: nothing is beaten.
        ([(10, .5), (20, .7)], [(10, .5), (20, .7)], False),
        # A only adds a cheaper, weaker point outside B's frontier: nothing of B is beaten.
        ([(5, .3), (10, .5), (20, .7)], [(10, .5), (20, .7)], False),
        # B's own dominated point is no win for A (frontiers are compared, not raw points).
        ([(10, .5), (20, .7)], [(10, .5), (20, .7), (30, .6)], False),
        # Crossing frontiers: A wins at low cost but does not reach B's best accuracy.
        ([(10, .7), (20, .7)], [(10, .5), (20, .9)], False),
        # An empty B is never dominated; an empty A dominates nothing.
        ([(10, .5)], [], False),
        ([], [(10, .5)], False),
    ],
)
def test_frontier_dominance_definition(a, b, a_dominates_b):
    assert frontier_dominates(points(*a), points(*b)) is a_dominates_b


def test_crossing_frontiers_dominate_neither_way():
    a, b = points((10, .7), (20, .7)), points((10, .5), (20, .9))
    assert not frontier_dominates(a, b) and not frontier_dominates(b, a)
    strong, weak = points((10, .6), (20, .8)), points((10, .5), (20, .7))
    assert frontier_dominates(strong, weak) and not frontier_dominates(weak, strong)


def make_cell(method: str, budget: int, split: str, accuracy: float, tokens: float,
              path: float) -> CellResult:
    def around(value: float, spread: float) -> Estimate:
        return Estimate(value, value - spread, value + spread)

    return CellResult(
        method=method, kind="clones" if method == "clones" else "monolithic", samples=1,
        budget=budget, split=split, tasks=20, trees=20,
        accuracy=around(accuracy, 0.1), total_tokens=around(tokens, 10.0),
        critical_path_tokens=around(path, 5.0), clones=2.0 if method == "clones" else 0.0,
        spawn_error_rate=0.0, budget_truncated_rate=0.1, error_rate=0.0, reward=accuracy,
    )


@pytest.fixture
def results() -> EvalResults:
    """In distribution, clones are more accurate but use a few more tokens in total, while
    their critical path is much shorter; out of distribution, monolithic wins outright."""
    table = {
        # (method, split): [(budget, accuracy, total tokens, critical path)]
        ("clones", "id"): [(128, .6, 120, 60), (256, .8, 220, 110)],
        ("mono", "id"): [(128, .5, 100, 100), (256, .7, 200, 200)],
        ("clones", "ood"): [(128, .3, 100, 100), (256, .4, 200, 200)],
        ("mono", "ood"): [(128, .5, 100, 100), (256, .6, 200, 200)],
    }
    cells = [
        make_cell(method, budget, split, accuracy, tokens, path)
        for (method, split), rows in table.items()
        for budget, accuracy, tokens, path in rows
    ]
    return EvalResults(cells=cells, splits={"id": 20, "ood": 20}, methods=["clones", "mono"],
                       budgets=[128, 256], settings={"seed": 0, "bootstrap_samples": 1000})


def test_compare_frontiers_per_split_and_cost(results):
    assert method_points(results, "clones", "id", "critical_path_tokens") == [
        ParetoPoint(60, .6, "clones @ 128"), ParetoPoint(110, .8, "clones @ 256")]
    assert compare_frontiers(results, "clones", "mono",
                             "total_tokens") == {"id": False, "ood": False}
    assert compare_frontiers(results, "clones", "mono",
                             "critical_path_tokens") == {"id": True, "ood": False}
    assert compare_frontiers(results, "mono", "clones") == {"id": False, "ood": True}
    with pytest.raises(KeyError, match="sc@4"):
        compare_frontiers(results, "sc@4", "mono")
    with pytest.raises(ValueError, match="cost metric"):
        compare_frontiers(results, "clones", "mono", "wall_time")


def test_report_files_from_results(results, tmp_path):
    files = write_report(results, tmp_path / "report")

    assert EvalResults.load(files.json).to_dict() == results.to_dict()
    with open(files.csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["method"], r["split"], r["budget"]) for r in rows] == [
        (c.method, c.split, str(c.budget)) for c in results.cells]
    assert float(rows[0]["accuracy_low"]) == pytest.approx(0.5)

    markdown = files.markdown.read_text()
    assert ("| clones | 128 | 0.600 [0.500, 0.700] | 120.0 [110.0, 130.0] | 60.0 [55.0, 65.0] | "
            "2.00 |") in markdown
    # Per split: dominance on total tokens / on critical-path tokens.
    assert "| clones | mono | no / yes | no / no |" in markdown
    assert "| mono | clones | no / no | yes / yes |" in markdown

    for cost, path in files.plots.items():
        image = imread(path)
        assert image.shape[1] > 1.5 * image.shape[0], cost  # one panel per split
        assert image[..., :3].std() > 0.05


def test_plot_has_one_panel_per_split(results, tmp_path):
    single = EvalResults(cells=results.select(split="id"), splits={"id": 20},
                         methods=results.methods, budgets=results.budgets)
    one = imread(plot_pareto(single, "total_tokens", tmp_path / "one.png"))
    two = imread(plot_pareto(results, "total_tokens", tmp_path / "two.png"))
    assert one.shape[0] == two.shape[0] and two.shape[1] > 1.8 * one.shape[1]
    with pytest.raises(ValueError, match="cost"):
        plot_pareto(results, "latency", tmp_path / "bad.png")
