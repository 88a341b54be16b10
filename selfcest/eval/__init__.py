"""Budget-matched evaluation (clones vs monolithic vs self-consistency), Pareto frontiers,
reports, and the HTML trace viewer."""

from selfcest.eval.evaluate import (
    Method,
    PolicyLike,
    Vote,
    evaluate,
    majority_vote,
    method_from_mapping,
    normalize_answer,
    run_evaluation,
)
from selfcest.eval.pareto import (
    ParetoPoint,
    compare_frontiers,
    frontier_dominates,
    method_points,
    pareto_frontier,
    plot_pareto,
)
from selfcest.eval.report import ReportFiles, markdown_report, write_report
from selfcest.eval.results import CellResult, EvalResults
from selfcest.eval.stats import Estimate, bootstrap_mean, bootstrap_ratio
from selfcest.eval.view import read_trees, render_html

__all__ = [
    "CellResult",
    "Estimate",
    "EvalResults",
    "Method",
    "ParetoPoint",
    "PolicyLike",
    "ReportFiles",
    "Vote",
    "bootstrap_mean",
    "bootstrap_ratio",
    "compare_frontiers",
    "evaluate",
    "frontier_dominates",
    "majority_vote",
    "markdown_report",
    "method_from_mapping",
    "method_points",
    "normalize_answer",
    "pareto_frontier",
    "plot_pareto",
    "read_trees",
    "render_html",
    "run_evaluation",
    "write_report",
]
