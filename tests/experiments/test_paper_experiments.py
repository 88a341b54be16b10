"""The README's commands for the paper's runs and for one's own data, run line by line.

Each line runs in a folder holding small files in the downloaded datasets' formats
(`dataset_sources`): a prepare line calls its script's ``main`` with the line's arguments; a
training line runs in a shell as a user runs it (`selfcest-train` as ``python -m
selfcest.train``, its equivalent), with ``/path/to/model`` a tiny stand-in model
(`write_stand_in`) and the step count and batch sizes made small (`SMALL`); nothing else is
changed. Marked ``paper`` (about 70 s): ``pytest -m paper``.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from dataset_sources import write_downloads
from helpers import commands, readme_blocks, script_main, shell

from selfcest.configure import CONFIG_DIR
from selfcest.policy import ClonePolicy

PAPER = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("paper_*.yaml"))
MODEL = "/path/to/model"  # the README's placeholder
# One step, evaluated; two prompts per step, two held-out tasks. The group size stays the
# paper's 4 trees, so groups hold both rewards of the stand-in.
SMALL = ("trainer.steps=1", "trainer.eval_every=1", "trainer.prompts_per_step=2", "task.eval_size=2")
# Experiments whose answers the stand-in can write ("7", as the sources' answers): their
# groups differ and the step updates the weights. The arithmetic tasks' answers are large
# integers it never writes, so their groups tie and the step trains nothing (every group is
# dropped as carrying no signal); in the mixed run almost every drawn task is arithmetic.
EARNED = {"paper_aime", "paper_math_hard", "paper_2wiki", "paper_musique"}


PREPARE, TRAIN = (commands(block) for block in readme_blocks("## Reproducing the paper's runs"))
OWN_DATA = commands(readme_blocks("### Your own data")[0])


def runnable(command: str, model: Path) -> str:
    """The README line as this checkout runs it: `selfcest-train` with this Python, the
    stand-in model, and the small sizes after it."""
    if command.startswith("selfcest-train "):
        command = command.replace("selfcest-train", f"{sys.executable} -m selfcest.train", 1)
        command = " ".join([command.replace(f"model.name={MODEL}", f"model.name={model}"), *SMALL])
    return command


def write_stand_in(folder: Path) -> None:
    """A tiny random Qwen2 (Hermes tool calls, as `model=hf` uses) that ends its turn at
    once when greedy, and writes a few "7" and newline tokens first when sampling.

    A random model writes garbage up to its budget (4096 tokens per node in these runs, minutes
    on a CPU). This one samples about 3 tokens, and the last line it writes is "7" in about a
    quarter of its outputs, so on tasks whose answer is 7 a group of 4 trees mostly holds both
    rewards; evaluation (greedy) ends at once. How: every input embedding gets one shared
    direction, which then dominates the residual stream, so the last hidden state points
    along it whatever the text; the output rows (tied to the embeddings) of three tokens get
    more of it, so those tokens take nearly all the probability: the end of turn most, then
    newline, then "7".
    """
    policy = ClonePolicy.build_tiny(seed=0, size="tiny", protocol="tool")
    embeddings = policy.model.get_input_embeddings().weight
    direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    tokenizer = policy.tokenizer
    with torch.no_grad():
        embeddings += 2.0 * direction
        for token, weight in ((tokenizer.eos_token, 2.0), ("Ċ", 1.97), ("7", 1.95)):  # Ċ: newline
            embeddings[tokenizer.convert_tokens_to_ids(token)] += weight * direction
    policy.save_pretrained(folder)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder with the downloads, the README's prepare lines run in it, and the stand-in."""
    folder = tmp_path_factory.mktemp("paper_runs")
    write_downloads(folder)
    for command in PREPARE:  # in process: the same arguments, without a Python start-up each
        python, script, *args = shlex.split(command)
        assert python == "python" and script.startswith("scripts/"), command
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(folder)
            assert script_main(Path(script).stem)(args) == 0, command
    write_stand_in(folder / "stand_in")
    return folder


def train_command(experiment: str) -> str:
    (command,) = [c for c in TRAIN if f" experiment={experiment} " in f"{c} "]
    return command


def test_the_readme_trains_every_paper_experiment_once():
    assert sorted(re.search(r"experiment=(\S+)", c)[1] for c in TRAIN) == PAPER
    assert all(c.startswith("selfcest-train ") and f"model.name={MODEL}" in c for c in TRAIN)


@pytest.mark.paper
@pytest.mark.parametrize("experiment", PAPER)
def test_paper_experiment_trains_one_step_and_evaluates(experiment, workspace):
    done = shell(runnable(train_command(experiment), workspace / "stand_in"), workspace)
    assert done.returncode == 0, done.stderr[-3000:]
    output = workspace / "runs" / experiment  # trainer.output_dir: runs/${name}
    assert json.loads((output / "config.json").read_text())["name"] == experiment
    (step,) = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1 and step["gate/trees"] == 2 * 4
    assert "eval/accuracy" in step
    if experiment in EARNED:
        assert step["train/samples"] > 0 and step["train/optimizer_steps"] > 0, step


@pytest.mark.paper
def test_own_data_lines_train_one_step(tmp_path):
    for command in OWN_DATA:
        done = shell(runnable(command, tmp_path), tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    (step,) = [json.loads(line) for line in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1 and "eval/accuracy" in step
