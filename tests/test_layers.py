"""The package's layers: a module imports only from its own layer or the layers below it.

From the bottom: the data and the model (trees, budgets, protocols, tasks, the forward
pass); what samples and scores trees and turns scores into advantages; the policy that ties
a model to a protocol and an engine; training and evaluation; the experiments and the
command line on top. Every import counts, a function's own included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfcest

PACKAGE = Path(selfcest.__file__).parent

LAYERS = [
    {"configure", "budget", "tree", "protocol", "task", "tasks", "modeling", "templates",
     "machine"},
    {"rollout", "rewards", "algo"},
    {"policy"},
    {"train", "eval"},
    {"experiments", "cli", "__init__"},
]
LAYER = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """The top-level part of ``selfcest.<part>...`` (``__init__`` for the package itself)."""
    return module.split(".")[1] if "." in module else "__init__"


def imported(path: Path) -> set[str]:
    """The selfcest modules ``path`` imports (``from selfcest import x`` is ``selfcest.x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "selfcest"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "selfcest":
                names |= {f"selfcest.{a.name}" for a in node.names}
            elif node.module.startswith("selfcest."):
                names.add(node.module)
    return names


def upward_imports(layer: dict[str, int]) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        # `python -m selfcest.train` is the command line, whatever package it sits in.
        own = len(LAYERS) - 1 if module.endswith(".__main__") else layer[part_of(module)]
        for name in imported(path):
            if layer[part_of(name)] > own:
                found.append(f"{module} imports {name}")
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts == set(LAYER)


def test_no_import_points_up():
    assert upward_imports(LAYER) == []


def test_an_import_that_points_up_is_found():
    """The check itself: with policy placed below rollout, rollout's engine use by policy
    points up."""
    moved = {**LAYER, "policy": 0}
    assert "selfcest.policy imports selfcest.rollout.engine" in upward_imports(moved)
