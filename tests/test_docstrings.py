"""Every module docstring under selfcest/ says what the module is for in at most 15 lines; the
reasoning and detail live beside the code they explain (comments, function and class docstrings)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "selfcest"
MAX_LINES = 15
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_modules_found():
    assert len(MODULES) > 10


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_docstring_is_short(path):
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    lines = len(docstring.splitlines()) if docstring else 0
    assert lines <= MAX_LINES, (
        f"{path.relative_to(PACKAGE.parent)}: module docstring has {lines} lines (at most "
        f"{MAX_LINES}); move the reasoning into comments or docstrings beside the code")
