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
from dataset_sources import write_downloads
from helpers import README_MODEL as MODEL
from helpers import SMALL_RUN as SMALL
from helpers import commands, readme_blocks, script_main, shell, write_stand_in

from selfcest.configure import CONFIG_DIR

PAPER = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("paper_*.yaml"))
# Experiments whose answers the stand-in can write ("7", as the sources' answers): their
# groups differ and the step updates the weights. The arithmetic tasks' answers are large
# integers it never writes, so their groups tie and the step trains nothing (every group is
# dropped as carrying no signal); in the mixed run almost every drawn task is arithmetic.
EARNED = {"paper_aime", "paper_math_hard", "paper_2wiki", "paper_musique"}
# A group of 4 of the stand-in's trees all miss "7" with probability about 0.69^4 = 0.23
# (its rate of answering "7" is about 0.31 on any text), so two groups would both tie on
# about 1 machine in 20; six do on about 1 in 7000.
EARNED_PROMPTS = 6


PREPARE, TRAIN = (commands(block) for block in readme_blocks("## Reproducing the paper's runs"))
OWN_DATA = commands(readme_blocks("### Your own data")[0])


def runnable(command: str, model: Path, small: tuple[str, ...] = SMALL) -> str:
    """The README line as this checkout runs it: `selfcest-train` with this Python, the
    stand-in model, and the small sizes after it."""
    if command.startswith("selfcest-train "):
        command = command.replace("selfcest-train", f"{sys.executable} -m selfcest.train", 1)
        command = " ".join([command.replace(f"model.name={MODEL}", f"model.name={model}"), *small])
    return command


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
    prompts = EARNED_PROMPTS if experiment in EARNED else 2
    small = tuple(f"trainer.prompts_per_step={prompts}" if s.startswith("trainer.prompts_per_step=")
                  else s for s in SMALL)
    done = shell(runnable(train_command(experiment), workspace / "stand_in", small), workspace)
    assert done.returncode == 0, done.stderr[-3000:]
    output = workspace / "runs" / experiment  # trainer.output_dir: runs/${name}
    assert json.loads((output / "config.json").read_text())["name"] == experiment
    (step,) = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1 and step["gate/trees"] == prompts * 4
    assert "eval/accuracy" in step
    # A group whose trees differ in reward trains; one that ties is dropped.
    trains = step["gate/zero_variance_groups"] < prompts
    assert (step["train/samples"] > 0) == trains, step
    if experiment in EARNED:
        assert trains and step["train/optimizer_steps"] > 0, step


@pytest.mark.paper
def test_own_data_lines_train_one_step(tmp_path):
    for command in OWN_DATA:
        done = shell(runnable(command, tmp_path), tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    (step,) = [json.loads(line)
               for line in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1 and "eval/accuracy" in step
