"""Every command block of README.md and the user guide beside it (`helpers.USER_PAGES`) is run
by a test, or composed where it needs GPUs.

The paper runs' and own-data blocks are run by tests/experiments/test_paper_experiments.py;
this file runs the others and fails when a block has no test (`COVERED`). A line runs as a
user runs it (`helpers.shell`: the console scripts of this Python, in a temporary folder),
with only step counts, batch sizes, SFT steps and evaluation sizes made small by overrides
appended to it. Two of the `experiment=cpu_repro` training lines build 10,500 demonstrations
each (about 20 s apiece) and the third trains from what the second saved, so these three are
marked ``paper``, with the other README runs.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import string
import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser
from helpers import REPO, USER_PAGES, commands, readme_blocks, shell

from selfcest.cli import register_schemas
from selfcest.configure import compose, validate
from selfcest.experiments import cpu_repro
from selfcest.experiments import main as main_job
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends import registry
from selfcest.train.config import TrainConfig

register_schemas()

# Each heading of the user pages with fenced blocks: their languages in order ("" for a
# block that is not commands), and the tests that cover them.
COVERED = {
    # test_quickstart_make_targets_run_what_the_readme_says
    ("README.md", "## Quickstart"): ["bash"],
    # test_controller_lines_* (slow)
    ("README.md", "### RL decides when to delegate, and the decision follows the cost"): ["bash"],
    # experiments/test_smollm.py (slow)
    ("README.md", "### A real pretrained model: SmolLM2-135M-Instruct"): ["bash"],
    # test_notebook_snippet_prints_an_answer_a_tree_and_costs
    ("README.md", "## In a notebook"): ["python"],
    ("docs/architecture.md", "## How it works"): [""],  # a diagram
    # test_training_*, test_cpu_repro_training_lines_* (paper)
    ("docs/training.md", "## Training"): ["bash"],
    # test_eval_line_writes_the_trees_the_view_line_renders
    ("docs/training.md", "## Evaluation and traces"): ["bash"],
    # test_scaling_out_line_composes_and_validates_but_is_not_run
    ("docs/training.md", "## Scaling out"): ["bash"],
    # experiments/test_paper_experiments.py
    ("docs/paper_runs.md", "## Reproducing the paper's runs"): ["bash", "bash"],
    ("docs/paper_runs.md", "### Your own data"): ["bash"],  # experiments/test_paper_experiments.py
    ("docs/development.md", "## Development"): ["bash"],  # test_development_*, test_*_benchmark_*
    ("docs/development.md", "### Against TRL"): ["bash"],  # benchmarks/test_vs_trl.py (marked trl)
    ("docs/development.md", "### Layout"): [""],  # a file list
}


def fenced_blocks() -> dict[tuple[str, str], list[str]]:
    """Each (page, heading) of the user pages with the languages of the fenced blocks under
    it, in order."""
    blocks = {}
    for page in USER_PAGES:
        heading, fenced = None, False
        for line in (REPO / page).read_text().splitlines():
            if line.startswith("```"):
                if not fenced:
                    blocks.setdefault((page, heading), []).append(line[3:].strip())
                fenced = not fenced
            elif not fenced and re.match(r"#{2,3} ", line):
                heading = line
    return blocks


def test_every_block_of_the_user_pages_is_covered_by_a_test():
    assert fenced_blocks() == COVERED


def test_the_readme_is_short_and_every_page_of_the_docs_is_indexed():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    index = (REPO / "docs/README.md").read_text()
    pages = [page.name for page in (REPO / "docs").glob("*.md") if page.name != "README.md"]
    assert all(f"]({name})" in index for name in pages)


def ok(command: str, cwd) -> subprocess.CompletedProcess:
    """Run a line; fail with the line and its error output unless it succeeds."""
    done = shell(command, cwd)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- Quickstart

QUICKSTART = commands(readme_blocks("## Quickstart")[0])


def make_dry_run(target: str) -> str:
    """The last command ``make <target>`` would run (after the install it may need first)."""
    # Run from `make test` itself, make would add "Entering/Leaving directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO,
                          capture_output=True,
                          text=True, check=True, env=env)
    return done.stdout.splitlines()[-1]


def test_quickstart_make_targets_run_what_the_readme_says():
    """`make run` is the main job: the CPU reproduction, whose `run` test_cpu_repro.py drives
    end to end (slow, its quick variant), beside the controller's main sweep; `make test` is
    the default suite."""
    assert QUICKSTART == ["make run", "make test"]
    assert make_dry_run("run") == ".venv/bin/python -m selfcest.experiments.main"
    assert [args for args, _ in main_job.JOBS.values()] == [
        ["-m", "selfcest.experiments.cpu_repro"],
        ["-m", "selfcest.experiments.controller_sweep", "--config-name", "controller_main"]]
    assert cpu_repro.DEFAULT_EXPERIMENT == "cpu_repro"
    driver = ast.parse((REPO / "tests/experiments/test_cpu_repro.py").read_text())
    imported = {(node.module, alias.name) for node in driver.body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert {("selfcest.experiments.common", "compose"),
            ("selfcest.experiments.cpu_repro", "run")} <= imported
    assert make_dry_run("test") == ".venv/bin/python -m pytest -q"


# ----------------------------------------------------------------------------- In a notebook

(NOTEBOOK,) = readme_blocks("## In a notebook", "python")
SAVED = 'ClonePolicy.from_pretrained("runs/cpu_repro/clones/policy")'
SNIPPETS = {"as written": NOTEBOOK,
            "build_tiny": NOTEBOOK.replace(SAVED, "ClonePolicy.build_tiny()")}


@pytest.mark.parametrize("variant", SNIPPETS)
def test_notebook_snippet_prints_an_answer_a_tree_and_costs(variant, tmp_path, monkeypatch, capsys):
    """As written, on a tiny policy saved where `make run` saves the clone arm; and with the
    alternative its comment offers."""
    assert SAVED in NOTEBOOK
    ClonePolicy.build_tiny(seed=0).save_pretrained(tmp_path / "runs/cpu_repro/clones/policy")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    namespace = {}
    exec(compile(SNIPPETS[variant], "README.md", "exec"), namespace)
    tree = namespace["tree"]
    assert capsys.readouterr().out == f"{tree.answer}\n{tree.pretty()}\n{tree.costs()}\n"
    assert tree.answer and tree.costs().generated_tokens > 0


# ----------------------------------------------------------------------------- Training

DEFAULTS, GROUPS, CPU_REPRO, RESUME, SAME, SFT, FROM_SFT, HELP = commands(
    readme_blocks("## Training")[0])
SMALL = ("trainer.steps=1", "trainer.prompts_per_step=2", "warm_start.sft.steps=2")


def small(command: str, *extra: str) -> str:
    return " ".join([command, *SMALL, *extra])


def test_training_defaults_line_runs_and_the_resume_line_continues_it(tmp_path):
    ok(small(DEFAULTS), tmp_path)
    run = tmp_path / "runs/default"
    first = (run / "metrics.jsonl").read_text()
    # One step past the checkpoint: a change of config the resume must be told it may make.
    ok(small(RESUME, "trainer.steps=2", "'trainer.resume_changes=[trainer.steps]'"), tmp_path)
    # Appended to: a fresh run would rewrite step 1 (its timings differ).
    assert (run / "metrics.jsonl").read_text().startswith(first)
    assert [m["step"] for m in metrics(run)] == [1, 2]
    assert (run / "checkpoints/step_000002/state.json").is_file()


def test_training_line_with_groups_takes_them_and_the_last_step_count(tmp_path):
    ok(small(GROUPS), tmp_path)
    run = tmp_path / "runs/default"
    config = json.loads((run / "config.json").read_text())
    assert (config["model"]["name"], config["task"]["name"]) == ("small", "arithmetic")
    assert config["algo"]["credit"]["strategy"] == "ratio"  # algo=paper
    assert [m["step"] for m in metrics(run)] == [1]


def test_training_python_m_line_is_the_same_command(tmp_path):
    """``python -m selfcest.train ...``: any selfcest-train line; run with none of its keys."""
    assert SAME.endswith(" ...")
    ok(small(SAME.removesuffix(" ...")), tmp_path)
    assert [m["step"] for m in metrics(tmp_path / "runs/default")] == [1]


def test_training_help_line_lists_every_key(tmp_path):
    printed = ok(HELP, tmp_path).stdout
    for key in ("trainer.resume (str", "warm_start.policy (", "warm_start.sft.steps (int"):
        assert key in printed


@pytest.mark.paper
def test_cpu_repro_training_lines_warm_start_save_it_and_train_from_it(tmp_path):
    """The clone arm with its warm start; the warm start alone; RL from the saved one."""
    run = tmp_path / "runs/cpu_repro"
    ok(small(CPU_REPRO), tmp_path)
    assert len((run / "sft.jsonl").read_text().splitlines()) == 2
    assert [m["step"] for m in metrics(run)] == [1]
    ok(small(SFT), tmp_path)
    assert (run / "sft/model.safetensors").is_file()
    warm_started = (run / "sft.jsonl").stat().st_mtime_ns
    ok(small(FROM_SFT), tmp_path)
    assert (run / "sft.jsonl").stat().st_mtime_ns == warm_started  # no new warm start
    assert json.loads(
        (run / "config.json").read_text())["warm_start"]["policy"] == "runs/cpu_repro/sft"


# ----------------------------------------------------------------------------- Evaluation

EVAL, VIEW = commands(readme_blocks("## Evaluation and traces")[0])
EVAL_SMALL = ("tasks_per_split=2", "bootstrap_samples=10")


def test_eval_line_writes_the_trees_the_view_line_renders(tmp_path):
    ClonePolicy.build_tiny(seed=0).save_pretrained(tmp_path / "runs/x/policy")
    ok(" ".join([EVAL, *EVAL_SMALL]), tmp_path)
    assert (tmp_path / "runs/x/eval/results.md").is_file()
    # The view line's file is a real name: method, budget, split (`id`: in distribution).
    trees = shlex.split(VIEW)[1]
    written = sorted(p.name for p in (tmp_path / "runs/x/eval/trees").glob("clones__256__*.jsonl"))
    assert (tmp_path / trees).is_file(), written
    ok(VIEW, tmp_path)
    assert "<html" in (tmp_path / "trace.html").read_text()


# ----------------------------------------------------------------------------- Scaling out

SCALING = commands(readme_blocks("## Scaling out")[0])
RANKS = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def training_overrides(command: str) -> list[str]:
    """The overrides a line gives selfcest.train; for an accelerate line, once accelerate has
    parsed its flags and loaded its config file, which must be one the trainer runs."""
    words = shlex.split(string.Template(command).substitute(RANKS))
    if words[0] == "selfcest-train":
        return words[1:]
    assert words[:2] == ["accelerate", "launch"], command
    args = launch_command_parser().parse_args(words[2:])
    assert args.module and args.training_script == "selfcest.train", command
    config = load_config_from_file(str(REPO / args.config_file))
    assert config.distributed_type in ("MULTI_GPU", "FSDP"), args.config_file
    if config.distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2  # the trainer refuses FSDP1
    return args.training_script_args


@pytest.mark.parametrize("command", SCALING, ids=[f"line{i}" for i in range(len(SCALING))])
def test_scaling_out_line_composes_and_validates_but_is_not_run(command, tmp_path, monkeypatch):
    """These lines need GPUs and vLLM; here their configs are built and checked only (as if
    vLLM were installed: without it they stop there, naming the install step)."""
    overrides = [o.replace("=/path/to/model", f"={tmp_path}") for o in training_overrides(command)]
    config = compose("train", overrides, TrainConfig)
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    validate(config)
    assert config.rollout.backend == "vllm" and config.name == "paper_arithmetic"


# ----------------------------------------------------------------------------- Development

DEVELOPMENT = commands(readme_blocks("## Development")[0])
ROLLOUT_BENCH, STEP_BENCH, ROOFLINE_BENCH, CACHE_BENCH = [c for c in DEVELOPMENT
                                                          if c.startswith("python benchmarks/")]


def test_development_test_lines_use_declared_markers_and_existing_paths(pytestconfig):
    """The test lines are the suite itself: not run here, but what they name must exist."""
    tests = [c for c in DEVELOPMENT if not c.startswith("python benchmarks/")]
    assert tests[0] == "make test" and all("pytest" in c for c in tests[1:])
    declared = {marker.split(":")[0] for marker in pytestconfig.getini("markers")}  # pyproject's
    used = {m for c in tests for m in re.findall(r"pytest -m (\w+)", c)}
    assert used == {"slow", "paper", "distributed", "vllm"} and used <= declared
    paths = [w for c in tests for w in shlex.split(c) if w.startswith(("tests/", "scripts/"))]
    assert len(paths) == 3 and all((REPO / p).exists() for p in paths)


def test_rollout_benchmark_runs_on_a_tiny_saved_policy(tmp_path):
    ClonePolicy.build_tiny(seed=0).save_pretrained(tmp_path / "policy")
    printed = ok(f"{ROLLOUT_BENCH} --policy {tmp_path / 'policy'} --tasks 2 --repeats 1",
                 REPO).stdout
    assert "trees / flat =" in printed and "without the prefix cache" in printed
    assert re.search(r"^flat: 1 batches, \d+ forward passes, \d+ prefilled tokens", printed,
                     re.MULTILINE)
    assert re.search(r"^trees, no prefix cache: .* 0 taken from the prefix cache", printed,
                     re.MULTILINE)


def test_train_step_benchmark_runs_at_its_smallest():
    printed = ok(f"{STEP_BENCH} --sizes tiny --steps 1 --repeats 1 --trees 4", REPO).stdout
    for name in ("rows, overhead 512", "rows, overhead 32", "packed"):
        assert f"padding_frac ({name})" in printed
        assert f"ratio to rows, overhead 512 ({name})" in printed
    assert "efficiency (limit / update, rows, overhead 32)" in printed


def test_roofline_benchmark_runs_at_its_smallest():
    printed = ok(f"{ROOFLINE_BENCH} --model small --repeats 1", REPO).stdout
    for phase in ("decode", "update"):
        assert re.search(rf"^small  {phase} +(\d+\.\d+ +){{6}}\d+\.\d+$", printed,
                         re.MULTILINE), printed


def test_decode_cache_benchmark_runs_at_its_smallest():
    printed = ok(f"{CACHE_BENCH} --model large --prompt-tokens 6 --new-tokens 3 --rows 8 --pairs 2",
                 REPO).stdout
    assert re.search(r"^large +\d+\.\d+ +\d+\.\d+ +\d+\.\d+  True$", printed, re.MULTILINE), printed


# ----------------------------------------------------------------------------- Controller

SWEEP, ONE_RUN, QUICK = commands(readme_blocks("### RL decides when to delegate, and the decision "
                                               "follows the cost")[0])
# The one-run line at the quick variant's sizes, from the warm start the quick line saved.
CONTROLLER_SMALL = ("task.params.n_train=40", "task.params.n_test=12", "task.params.n_ood=12",
                    "task.params.sizes=[2,4,6]", "trainer.steps=2", "trainer.prompts_per_step=2",
                    "trainer.trees_per_prompt=4", "eval.tasks_per_split=4",
                    "eval.bootstrap_samples=50")


@pytest.mark.slow
def test_controller_lines_run_the_quick_variant_one_run_and_the_sweep(tmp_path):
    """The quick line as written; the one-run and sweep lines made small, from its warm
    start (about 2 minutes)."""
    ok(QUICK, tmp_path)
    warm = tmp_path / "runs/controller_quick/seed0/sft"
    assert (tmp_path / "runs/controller_quick/seed0/report.md").is_file()
    ok(" ".join([ONE_RUN, *CONTROLLER_SMALL, f"warm_start.policy={warm}"]), tmp_path)
    assert json.loads(
        (tmp_path / "runs/controller/seed0/results.json").read_text())["name"] == "controller"
    overrides = ",".join(f'"{o}"' for o in [*CONTROLLER_SMALL, f"warm_start.policy={warm}"])
    ok(f"{SWEEP} seeds=[0] experiments=[controller] credits=[broadcast] 'overrides=[{overrides}]'",
       tmp_path)
    assert "| controller | broadcast | 1 |" in (
        tmp_path / "runs/controller_sweep/summary.md").read_text()
