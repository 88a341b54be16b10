"""Trace viewer: escaping and structure without a browser, the command, evaluated trees, and
the page as headless Chromium renders it (skipped where Chromium is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from eval_helpers import ScriptedPolicy, delegation_script, exact_match, keyed_tasks
from matplotlib.image import imread

from selfcest.budget import Budget
from selfcest.eval import Method, evaluate
from selfcest.eval.view import main, read_trees, render_html
from selfcest.tree import CloneTree, Node, Segment, Spawn

# Each would change the page if it became markup: a script, an event handler, and an
# attempt to close the surrounding elements first.
SCRIPT = "<script>document.body.setAttribute('data-pwned', 'script')</script>"
IMG = "<img src=x onerror=\"document.body.setAttribute('data-pwned', 'img')\">"
BREAKOUT = "</pre></details></section>" + SCRIPT


def sampled(text: str, tokens: int = 3) -> Segment:
    return Segment("sampled", list(range(tokens)), [-0.5] * tokens, text)


def injected(kind: str, text: str) -> Segment:
    return Segment(kind, [7, 8], None, text)


def hostile_trees() -> list[CloneTree]:
    """Two trees whose every text field carries markup: one that delegates, one that fails."""
    tree = CloneTree(task_id="task-" + SCRIPT, task_index=0, sample_index=0, weight_version=0,
                     reward=1.0, correct=True,
                     info={"method": "clones", "budget": 64, "split": "id", "note": IMG})
    tree.add(Node(
        "0", None, 0, None, [1, 2, 3],
        segments=[sampled("<spawn>look @L1 " + SCRIPT + "<sep>@NOPE</spawn>", 5),
                  injected("return", "<return>" + IMG + "<sep>error: unknown key</return>"),
                  sampled("Answer: 42 " + BREAKOUT, 4)],
        spawns=[Spawn(0, ["0.0"], errors=["unknown context key(s) NOPE " + SCRIPT])],
        finish_reason="eos", answer="42 " + SCRIPT, generation_budget=64,
    ))
    tree.add(Node(
        "0.0", "0", 1, "look @L1 " + SCRIPT, [4, 5], context_keys=["L1"],
        segments=[sampled("Answer: 7 " + IMG + "\x06", 6), injected("notice", "cut " + BREAKOUT)],
        finish_reason="budget", answer="7", generation_budget=21,
    ))
    failed = CloneTree(task_id="task-failed", task_index=1, sample_index=0, reward=0.0,
                       correct=False)
    failed.add(Node("0", None, 0, None, [1], segments=[sampled("half " + IMG, 2)],
                    finish_reason="error", error="RuntimeError: " + SCRIPT, generation_budget=64))
    return [tree, failed]


def test_model_text_is_escaped_everywhere():
    page = render_html(hostile_trees(), title="traces " + SCRIPT)
    for raw in (SCRIPT, IMG, "<img", "</pre></details></section><script"):
        assert raw not in page
    assert page.count("<script") == 1  # the page's own
    assert "&lt;script&gt;document.body.setAttribute(&#39;data-pwned&#39;" in page  # autoescape's
    assert "onerror=&#34;document.body" in page  # spelling of ' and "
    # The hierarchy survives: one <details> per tree and per node, all closed properly.
    assert page.count("<details") == page.count("</details>") == 2 + 3
    assert "\\x06" in page and "\x06" not in page  # control characters shown, not swallowed


def test_template_syntax_in_model_text_is_printed_not_run():
    """Model text is data passed to the template, never compiled as one: Jinja syntax in it
    comes out as typed, and markup in it as text."""
    alert, jinja = "<script>alert(1)</script>", "{{ 7*7 }}{% for x in range(3) %}x{% endfor %}"
    tree = CloneTree(task_id=jinja, task_index=0, sample_index=0, info={"note": jinja})
    tree.add(Node("0", None, 0, None, [1], segments=[sampled(alert + jinja)], finish_reason="eos",
                  answer=jinja, error=alert))
    page = render_html([tree], title=jinja)
    body = page[page.index("<body>"):]
    assert body.count(jinja) == 6  # heading, task id, info, segment, answer twice
    assert body.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2  # segment, error
    assert "alert(1)</script>" not in page and ">49<" not in body and "xxx" not in body


def test_page_shows_nodes_segments_errors_and_costs():
    page = render_html(hostile_trees())
    assert not re.search(r"<[^>]*\b(src|href)\s*=", page)  # no element fetches anything
    assert "default-src 'none'" in page
    summary = page[page.index("<table class=\"summary\">"): page.index("</table>")]
    assert ("<td>all trees</td><td class=\"num\">2</td>"
            "<td class=\"num\">0.500 (2 scored)</td>") in summary
    assert "clones @ 64 on id" in summary and "trees without evaluation info" in summary
    assert "<td>all trees</td><td class=\"num\">0</td><td class=\"num\">n/a</td>" in render_html([])
    root_part, clone_part = page.split("<strong>clone 0.0</strong>", 1)
    assert "generated 9 / budget 64" in root_part  # 5 + 4 sampled tokens
    assert "context 14" in root_part  # 3 prompt + 5 sampled + 2 returned + 4 sampled
    assert "generated 6 / budget 21" in clone_part and "finish-budget" in clone_part
    for kind in ("sampled", "return", "notice"):
        assert f"class=\"seg seg-{kind}\"" in page
    assert "class=\"spawn-errors\"" in page and "unknown context key(s) NOPE" in page
    assert "RuntimeError: &lt;script&gt;" in page
    # Clones are nested inside their parent's <details>, under the spawn call.
    assert ('<div class="children"><details class="node" open>'
            '<summary><strong>clone 0.0</strong>') in page
    assert page.index("<strong>clone 0.0</strong>") < page.index("Answer: 42")


def test_command_renders_jsonl_files(tmp_path, capsys):
    trees = hostile_trees()
    source = tmp_path / "trees.jsonl"
    source.write_text("".join(t.to_json() + "\n" for t in trees))
    out = tmp_path / "trace.html"
    assert main([str(source), "-o", str(out), "--limit", "1", "--title", "mine"]) == 0
    page = out.read_text()
    assert "<title>mine</title>" in page and "task-&lt;script&gt;" in page
    assert "task-failed" not in page  # --limit 1
    assert "wrote 1 trees" in capsys.readouterr().out

    source.write_text(trees[0].to_json() + "\n{not json\n")
    with pytest.raises(SystemExit):
        main([str(source), "-o", str(out)])
    assert "trees.jsonl:2" in capsys.readouterr().err


def test_evaluated_trees_render_with_their_cells(tiny_policy, tmp_path):
    policy = ScriptedPolicy(tiny_policy.protocol, delegation_script)
    methods = [Method("clones", "clones", Budget(node_generation=64, tree_generation=64))]
    results = evaluate(policy, methods, {"id": keyed_tasks(2)}, [64], exact_match, tmp_path)
    trees = read_trees(tmp_path / results.cell("clones", 64, "id").trees_file)
    page = render_html(trees)
    assert "clones @ 64 on id" in page and "1.000 (2 scored)" in page
    assert page.count("<details class=\"node\"") == sum(len(t.nodes) for t in trees) == 6
    assert "sum @L1" in page and "seg-return" in page


# ---------------------------------------------------------------------------- Chromium

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="Chromium is not installed (apt-get install chromium)")


def chromium(tmp_path, *args: str) -> str:
    """Run headless Chromium offline with a throwaway profile; return its stdout."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def page_url(tmp_path) -> str:
    path = tmp_path / "trace.html"
    path.write_text(render_html(hostile_trees(), title="hostile"), encoding="utf-8")
    return path.as_uri()


@needs_chromium
def test_chromium_dom_holds_the_text_and_no_injected_element(tmp_path, page_url):
    dom = chromium(tmp_path, "--dump-dom", page_url)
    assert "<title>hostile</title>" in dom
    assert dom.count("<script") == 1 and "<img" not in dom  # injected markup stayed text
    assert "data-pwned=" not in dom  # and nothing injected ran
    assert 'data-js="on"' in dom  # while the page's own script did (its CSP hash matches)
    assert ("look @L1 &lt;script&gt;document.body.setAttribute('data-pwned', "
            "'script')&lt;/script&gt;") in dom
    assert "Answer: 42" in dom and "unknown context key(s) NOPE" in dom
    assert dom.count("<details") == 5


@needs_chromium
def test_chromium_screenshot_is_not_blank(tmp_path, page_url):
    shot = tmp_path / "trace.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page_url)
    image = imread(shot)[..., :3]
    assert image.shape[:2] == (900, 1200)
    assert image.std() > 0.05
    assert len({tuple(p) for p in (image[::7, ::7] * 255).astype(int).reshape(-1, 3)}) > 20
