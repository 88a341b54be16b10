"""What an evaluation measured: one `CellResult` per method × budget × split.

These records are plain data: `evaluate` fills them, `report` and `pareto` read them, and
``results.json`` round-trips them (`EvalResults.load`) so a report can be redrawn without
rolling anything out again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from selfcest.eval.stats import Estimate

CostMetric = Literal["total_tokens", "critical_path_tokens"]
COST_METRICS: tuple[CostMetric, ...] = ("total_tokens", "critical_path_tokens")


@dataclass
class CellResult:
    """Metrics of one method at one total-token budget on one task split.

    Every figure is a mean over tasks. For self-consistency a task's figures are those of its
    vote: correctness and reward of the elected answer, tokens and clones summed over the k
    samples, critical path the longest sample (they run in parallel), rates averaged over
    the samples.
    """

    method: str  # the method's name
    kind: str  # "clones", "monolithic" or "self_consistency"
    samples: int  # trees per task (k for self-consistency, else 1)
    budget: int  # total generated tokens allowed per task (all samples together)
    split: str  # task split name
    tasks: int  # tasks evaluated
    trees: int  # trees rolled out (tasks × samples)
    accuracy: Estimate  # fraction of tasks answered correctly
    total_tokens: Estimate  # generated tokens per task, all nodes of all samples
    critical_path_tokens: Estimate  # sequential latency proxy per task, in tokens
    clones: float  # clones per task
    spawn_error_rate: float  # fraction of trees with at least one spawn error entry
    budget_truncated_rate: float  # fraction of trees whose root stopped on a budget
    error_rate: float  # fraction of trees whose root failed with an error
    reward: float  # mean reward_fn score
    trees_file: str | None = None  # JSONL of the trees, relative to the output folder

    def cost(self, metric: CostMetric) -> Estimate:
        """The cost estimate a Pareto plot puts on its x axis."""
        if metric not in COST_METRICS:
            raise ValueError(f"cost metric must be one of {COST_METRICS}, got {metric!r}")
        return getattr(self, metric)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        for name in ("accuracy", *COST_METRICS):
            data[name] = Estimate(**data[name])
        return cls(**data)


@dataclass
class EvalResults:
    """All cells of one evaluation, plus the settings that produced them."""

    cells: list[CellResult]
    splits: dict[str, int]  # split name -> number of tasks, in report order
    methods: list[str]  # method names, in report order
    budgets: list[int]  # the sweep, ascending
    settings: dict[str, Any] = field(default_factory=dict)  # seed, sampling, method budgets…

    def cell(self, method: str, budget: int, split: str) -> CellResult:
        for cell in self.cells:
            if (cell.method, cell.budget, cell.split) == (method, budget, split):
                return cell
        raise KeyError(f"no result for method {method!r}, budget {budget}, split {split!r}")

    def select(self, method: str | None = None, split: str | None = None) -> list[CellResult]:
        """Cells of one method and/or split, in budget order."""
        chosen = [
            c for c in self.cells
            if (method is None or c.method == method) and (split is None or c.split == split)
        ]
        return sorted(chosen, key=lambda c: (self.methods.index(c.method), c.budget))

    def to_dict(self) -> dict[str, Any]:
        return {
            "splits": self.splits,
            "methods": self.methods,
            "budgets": self.budgets,
            "settings": self.settings,
            "cells": [c.to_dict() for c in self.cells],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResults:
        return cls(
            cells=[CellResult.from_dict(c) for c in data["cells"]],
            splits=dict(data["splits"]),
            methods=list(data["methods"]),
            budgets=list(data["budgets"]),
            settings=dict(data.get("settings", {})),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> EvalResults:
        return cls.from_dict(json.loads(Path(path).read_text()))
