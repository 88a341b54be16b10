"""The package's import graph: no cycles, and imports at the top of modules.

An import inside a function hides a cycle or an optional dependency; only the latter is
allowed, and only for the modules listed here (each is optional, or runs in a subprocess
that reports its own import failure).
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfcest

PACKAGE = Path(selfcest.__file__).parent
# Imported inside functions on purpose: optional extras, or slow imports only some runs need.
LAZY = {
    "vllm", "vllm.v1.executor",  # the vllm extra
    "reasoning_gym",  # the gym extra
    "pyarrow.parquet",  # parquet inputs only
    "wandb", "torch.utils.tensorboard",  # only runs that log there
    "sympy", "sympy.matrices", "math_verify",  # the math worker reports a failed import itself
    "matplotlib.figure",  # plots only
    # Hydra apps only: the library runs without them (the GPU check's machine has neither).
    "hydra", "hydra.core.global_hydra", "omegaconf", "omegaconf.errors",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
    return [base]


def graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the selfcest modules it imports at module level; and every import made
    inside a function, as ``module:line name``."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    inside: list[str] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, name, is_package):
                    resolved = _resolve(target, node, modules)
                    edges[name].update(resolved)
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        inside += [f"{name}:{node.lineno} {t}"
                                   for t in imported(node, name, is_package)]
    return edges, inside


def _resolve(target: str, node, modules) -> set[str]:
    """The selfcest modules an import statement loads (``from pkg import submodule`` too)."""
    found = {target} if target in modules else set()
    if isinstance(node, ast.ImportFrom):
        found |= {f"{target}.{alias.name}" for alias in node.names
                  if f"{target}.{alias.name}" in modules}
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def test_the_import_graph_has_no_cycle():
    edges, _ = graph()
    assert sum(len(targets) for targets in edges.values()) > 100  # the walk saw the package
    assert cycles(edges) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_imports_inside_functions_are_only_optional_dependencies():
    _, inside = graph()
    unexpected = [entry for entry in inside if entry.split(" ", 1)[1] not in LAZY]
    assert unexpected == []
