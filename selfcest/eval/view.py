"""Trace viewer: clone trees as one self-contained HTML page (``selfcest-view``).

The page needs no network and no file beside it: CSS and the expand/collapse script are
inline, and a Content-Security-Policy forbids every fetch and allows only that one script
(by its hash). Each tree is a collapsible hierarchy of ``<details>`` elements, one per node,
its clones nested under the spawn call that started them.

Everything that comes from a tree (model text, objectives, answers, errors, task ids, info)
is untrusted and goes through `html.escape`; the hash-pinned policy is a second wall should
an escape ever be missed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import re
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean

from selfcest.tree import CloneTree, Node

# C0 controls (but tab and newline) and DEL are invisible in a browser and invalid in HTML:
# they are shown as \xNN so a reader sees what the model emitted.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.4em; margin: 0 0 .5em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
button { margin: 0 .4em .8em 0; }
body:not([data-js]) #controls { display: none; }  /* the buttons need the script */
details { margin: .3em 0; }
details.tree { border: 1px solid #bbb; border-radius: 6px; padding: .3em .6em; }
details.tree > summary { font-weight: 600; cursor: pointer; }
details.node { border-left: 3px solid #8aa4d6; padding-left: .6em; margin-left: .4em; }
details.node > summary { cursor: pointer; }
.children { margin-left: 1.2em; }
pre { white-space: pre-wrap; word-break: break-word; margin: .2em 0; padding: .3em .5em;
      font-size: .85em; border-radius: 4px; }
.tag { font-size: .75em; text-transform: uppercase; letter-spacing: .04em; color: #555; }
.seg-sampled pre { background: #f6f8fa; border: 1px solid #e1e4e8; }
.seg-return pre { background: #e8f5e9; border: 1px solid #7cb342; }
.seg-notice pre { background: #fff8e1; border: 1px solid #ffb300; }
.objective pre { background: #e3f2fd; border: 1px solid #64b5f6; }
.error, .spawn-errors { color: #b71c1c; }
.spawn-errors ul { margin: .2em 0; font-size: .85em; }
.ok { color: #1b5e20; }
.wrong { color: #b71c1c; }
.badge { display: inline-block; font-size: .75em; padding: 0 .4em; border-radius: 3px;
         background: #eee; margin: 0 .3em; }
.finish-eos { background: #c8e6c9; }
.finish-budget { background: #ffe0b2; }
.finish-error { background: #ffcdd2; }
.stat { color: #555; font-size: .85em; margin-right: .6em; }
.answer { font-family: monospace; }
dl.info { display: grid; grid-template-columns: max-content auto; gap: .1em .8em;
          font-size: .85em; margin: .3em 0; }
dl.info dt { color: #555; }
dl.info dd { margin: 0; font-family: monospace; }
"""

SCRIPT = """
document.body.dataset.js = "on";
for (const [id, open] of [["expand-all", true], ["collapse-all", false]]) {
  document.getElementById(id).addEventListener("click", () => {
    document.querySelectorAll("details").forEach((d) => { d.open = open; });
  });
}
"""


def render_html(trees: Sequence[CloneTree], title: str = "selfcest traces") -> str:
    """One self-contained HTML page: a summary table, then every tree, collapsible."""
    script_hash = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    policy = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    body = "\n".join(_tree(tree, i) for i, tree in enumerate(trees))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<title>{_text(title)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>{_text(title)}</h1>
{_summary(trees)}
<div id="controls"><button id="expand-all" type="button">Expand all</button><button id="collapse-all" type="button">Collapse all</button></div>
<section id="trees">
{body}
</section>
<script>{SCRIPT}</script>
</body>
</html>
"""


def _text(value: object) -> str:
    """Untrusted text, made visible and inert."""
    return html.escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value)), quote=True)


# ---------------------------------------------------------------------------- summary


def _summary(trees: Sequence[CloneTree]) -> str:
    """Per evaluation cell (method, budget, split from the trees' info) and overall."""
    groups: dict[str, list[CloneTree]] = {}
    for tree in trees:
        groups.setdefault(_group(tree), []).append(tree)
    rows = [("all trees", list(trees))]
    if len(groups) > 1 or "" not in groups:
        rows += list(groups.items())  # in file order: method by method, budget by budget
    head = ("trees", "accuracy (per tree)", "mean reward", "mean generated tokens",
            "mean critical path", "mean clones")
    lines = ["<table class=\"summary\"><thead><tr><th>group</th>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for name, members in rows:
        costs = [t.costs() for t in members]
        scored = [t for t in members if t.correct is not None]
        rewarded = [t.reward for t in members if t.reward is not None]
        cells = [
            str(len(members)),
            f"{fmean(t.correct for t in scored):.3f} ({len(scored)} scored)" if scored else "n/a",
            f"{fmean(rewarded):.3f}" if rewarded else "n/a",
            f"{fmean(c.generated_tokens for c in costs):.1f}" if costs else "n/a",
            f"{fmean(c.critical_path_tokens for c in costs):.1f}" if costs else "n/a",
            f"{fmean(c.clones for c in costs):.2f}" if costs else "n/a",
        ]
        label = _text(name or "trees without evaluation info")
        numbers = "".join(f"<td class=\"num\">{c}</td>" for c in cells)
        lines.append(f"<tr><td>{label}</td>{numbers}</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _group(tree: CloneTree) -> str:
    info = tree.info
    if "method" not in info:
        return ""
    return f"{info['method']} @ {info.get('budget', '?')} on {info.get('split', '?')}"


# ---------------------------------------------------------------------------- trees


def _tree(tree: CloneTree, index: int) -> str:
    costs = tree.costs()
    if tree.correct is None:
        verdict = "<span>unscored</span>"
    elif tree.correct:
        verdict = "<span class=\"ok\">&#10003; correct</span>"
    else:
        verdict = "<span class=\"wrong\">&#10007; wrong</span>"
    group = _group(tree)
    reward = f" · reward {tree.reward:.3f}" if tree.reward is not None else ""
    summary = (
        f"#{index} task {_text(tree.task_id)} sample {tree.sample_index}"
        + (f" · {_text(group)}" if group else "")
        + f" · {verdict}{reward} · {costs.generated_tokens} tokens"
        f" · critical path {costs.critical_path_tokens} · {costs.clones} clones"
        f" · answer <span class=\"answer\">{_text(tree.answer)}</span>"
    )
    stats = {
        "generated tokens": costs.generated_tokens,
        "root / clone tokens": f"{costs.root_generated_tokens} / {costs.clone_generated_tokens}",
        "critical-path tokens": costs.critical_path_tokens,
        "context tokens processed": costs.context_tokens,
        "peak context": costs.peak_context,
        "clones": costs.clones,
        "depth": costs.depth,
        "spawn errors": costs.spawn_errors,
        "weight version": tree.weight_version,
    }
    info = {key: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for key, value in tree.info.items()}
    return (
        f"<details class=\"tree\" id=\"tree-{index}\"{' open' if index == 0 else ''}>"
        f"<summary>{summary}</summary>\n"
        + _definitions(stats)
        + _definitions(info)
        + _node(tree, tree.root)
        + "</details>"
    )


def _definitions(items: dict[str, object]) -> str:
    pairs = "".join(f"<dt>{_text(k)}</dt><dd>{_text(v)}</dd>" for k, v in items.items())
    return f"<dl class=\"info\">{pairs}</dl>\n"


def _node(tree: CloneTree, node: Node) -> str:
    label = "root" if node.parent_id is None else f"clone {node.id}"
    budget = node.generation_budget if node.generation_budget is not None else "?"
    summary = (
        f"<strong>{_text(label)}</strong>"
        f"<span class=\"badge finish-{_text(node.finish_reason)}\">{_text(node.finish_reason)}</span>"
        f"<span class=\"stat\">generated {node.generated_tokens} / budget {_text(budget)}</span>"
        f"<span class=\"stat\">context {node.context_length}</span>"
        f"<span class=\"stat\">critical path {tree.critical_path(node.id)}</span>"
        f"answer <span class=\"answer\">{_text(node.answer)}</span>"
    )
    parts = []
    if node.objective is not None:
        parts.append(f"<div class=\"objective\"><span class=\"tag\">objective</span>"
                     f"<pre>{_text(node.objective)}</pre></div>")
    if node.context_keys:
        parts.append(f"<div><span class=\"tag\">context keys</span> {_text(', '.join(node.context_keys))}</div>")
    if node.error:
        parts.append(f"<div class=\"error\">error: {_text(node.error)}</div>")
    if tree.node_rewards and node.id in tree.node_rewards:
        parts.append(f"<div><span class=\"tag\">node reward</span> {tree.node_rewards[node.id]:.3f}</div>")
    spawns = {spawn.segment_index: spawn for spawn in node.spawns}
    for i, segment in enumerate(node.segments):
        parts.append(
            f"<div class=\"seg seg-{_text(segment.kind)}\"><span class=\"tag\">{_text(segment.kind)}"
            f" · {len(segment.token_ids)} tokens</span><pre>{_text(segment.text)}</pre></div>"
        )
        spawn = spawns.get(i)
        if spawn is None:
            continue
        if spawn.errors:
            items = "".join(f"<li>{_text(error)}</li>" for error in spawn.errors)
            parts.append(f"<div class=\"spawn-errors\"><span class=\"tag\">spawn errors</span><ul>{items}</ul></div>")
        if spawn.child_ids:
            children = "".join(_node(tree, tree.nodes[child]) for child in spawn.child_ids)
            parts.append(f"<div class=\"children\">{children}</div>")
    return f"<details class=\"node\" open><summary>{summary}</summary>\n" + "\n".join(parts) + "</details>\n"


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
        description="Render clone trees (JSONL, one tree per line) as one self-contained HTML page.",
    )
    parser.add_argument("trees", nargs="+", type=Path, help="JSONL files of clone trees")
    parser.add_argument("-o", "--output", type=Path, default=Path("trace.html"), help="HTML file to write")
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
