"""Trace viewer: clone trees as one self-contained HTML page (``selfcest-view``).

The page needs no network and no file beside it: CSS and the expand/collapse script are
inline, and a Content-Security-Policy forbids every fetch and allows only that one script
(by its hash). Each tree is a collapsible hierarchy of ``<details>`` elements, one per node,
its clones nested under the spawn call that started them.

The page is the template ``selfcest/templates/trace.html.j2``, rendered with autoescape:
everything that comes from a tree (model text, objectives, answers, errors, task ids, info)
is untrusted and printed as text, and none of it is ever compiled as a template. The
hash-pinned policy is a second wall should markup ever get through.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
from collections.abc import Sequence
from functools import partial
from importlib import resources
from pathlib import Path
from statistics import fmean

from markupsafe import Markup

from selfcest.templates import environment
from selfcest.tree import CloneTree

# C0 controls (but tab and newline) and DEL are invisible in a browser and invalid in HTML:
# they are shown as \xNN so a reader sees what the model emitted.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

# The page's one script, read from a file and passed in as it is: the CSP hash must be taken
# of exactly the text the page carries, and rendering it as a template could change a byte
# (Jinja drops a template's final newline).
SCRIPT = resources.files("selfcest.templates").joinpath("trace.js").read_text(encoding="utf-8")


def _visible(value: object) -> object:
    """Every printed value passes here before autoescape: control characters made visible.
    The page's own markup (the script, rendered macros) passes as it is."""
    if isinstance(value, Markup):
        return value
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


_ENVIRONMENT = environment(html=True, finalize=_visible)
_ENVIRONMENT.filters["json"] = partial(json.dumps, ensure_ascii=False)


def render_html(trees: Sequence[CloneTree], title: str = "selfcest traces") -> str:
    """One self-contained HTML page: a summary table, then every tree, collapsible."""
    script_hash = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    return _ENVIRONMENT.get_template("trace.html.j2").render(
        title=title, script=Markup(SCRIPT), script_hash=script_hash, summary=_summary(trees),
        trees=[(tree, _group(tree)) for tree in trees],
    )


# ---------------------------------------------------------------------------- summary


def _summary(trees: Sequence[CloneTree]) -> list[tuple[str, list[str]]]:
    """Per evaluation cell (method, budget, split from the trees' info) and overall: a label
    and the table's figures, formatted."""
    groups: dict[str, list[CloneTree]] = {}
    for tree in trees:
        groups.setdefault(_group(tree), []).append(tree)
    rows = [("all trees", list(trees))]
    if len(groups) > 1 or "" not in groups:
        rows += list(groups.items())  # in file order: method by method, budget by budget
    return [(name or "trees without evaluation info", _figures(members)) for name, members in rows]


def _figures(members: list[CloneTree]) -> list[str]:
    costs = [t.costs() for t in members]
    scored = [t for t in members if t.correct is not None]
    rewarded = [t.reward for t in members if t.reward is not None]
    return [
        str(len(members)),
        f"{fmean(t.correct for t in scored):.3f} ({len(scored)} scored)" if scored else "n/a",
        f"{fmean(rewarded):.3f}" if rewarded else "n/a",
        f"{fmean(c.generated_tokens for c in costs):.1f}" if costs else "n/a",
        f"{fmean(c.critical_path_tokens for c in costs):.1f}" if costs else "n/a",
        f"{fmean(c.clones for c in costs):.2f}" if costs else "n/a",
    ]


def _group(tree: CloneTree) -> str:
    info = tree.info
    if "method" not in info:
        return ""
    return f"{info['method']} @ {info.get('budget', '?')} on {info.get('split', '?')}"


# ---------------------------------------------------------------------------- command


def read_trees(path: str | Path) -> list[CloneTree]:
    """Clone trees from a JSONL file (one `CloneTree.to_json` per line)."""
    path = Path(path)
    trees = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                trees.append(CloneTree.from_json(line))
            except (ValueError, TypeError, KeyError) as error:
                raise ValueError(f"{path}:{number}: not a clone tree ({error})") from error
    return trees


def main(argv: Sequence[str] | None = None) -> int:
    """``selfcest-view trees.jsonl [more.jsonl …] -o trace.html``."""
    parser = argparse.ArgumentParser(
        prog="selfcest-view",
        description=("Render clone trees (JSONL, one tree per line) as one self-contained "
                     "HTML page."),
    )
    parser.add_argument("trees", nargs="+", type=Path, help="JSONL files of clone trees")
    parser.add_argument("-o", "--output", type=Path, default=Path("trace.html"),
                        help="HTML file to write")
    parser.add_argument("--title", help="page title (default: the input file names)")
    parser.add_argument("--limit", type=int, help="render only the first LIMIT trees")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    trees = []
    for path in args.trees:
        try:
            trees.extend(read_trees(path))
        except (OSError, ValueError) as error:
            parser.error(str(error))
    if args.limit is not None:
        trees = trees[: args.limit]
    title = args.title or ", ".join(path.name for path in args.trees)
    args.output.write_text(render_html(trees, title=title), encoding="utf-8")
    print(f"wrote {len(trees)} trees to {args.output}")
    return 0
