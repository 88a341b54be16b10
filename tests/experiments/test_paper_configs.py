"""The paper experiments' configs, composed as the command line composes them: the credit
each gives a clone, and the proportions the mixed run draws its sources in."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import fill_missing
from hydra import compose, initialize_config_dir

from selfcest.algo.advantages import compute_advantages
from selfcest.cli import register_schemas
from selfcest.configure import CONFIG_DIR, build
from selfcest.rewards.base import score_trees
from selfcest.tasks import Task, write_jsonl
from selfcest.train.config import TrainConfig, load_split
from selfcest.train.setup import build_reward
from selfcest.train.trainer import TaskSampler
from selfcest.tree import CloneTree, Node, Segment, Spawn

register_schemas()
PAPER = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("paper_*.yaml"))

# The clone/root advantage ratio the paper code gives a well-formed clone of a correct root:
# its math reward gives the clone s / 2.5, so 0.4; its arithmetic and long-context rewards
# give the clone the root's score, so 1. Per task source (the mixed run routes by source).
PAPER_RATIO = {"aime": 0.4, "math_hard": 0.4, "arithmetic": 1.0, "2wiki": 1.0, "musique": 1.0}
SOURCES = {
    "paper_arithmetic": ["arithmetic"], "paper_no_clone": ["arithmetic"], "paper_aime": ["aime"],
    "paper_math_hard": ["math_hard"], "paper_2wiki": ["2wiki"], "paper_musique": ["musique"],
    "paper_mixed": ["aime", "math_hard", "arithmetic"],
}
# configs/algo/paper.yaml's ratio_smoothing d = 1e-4 gives (0.4 s + d) / (s + d) for a root
# score s in [0.5, 1]: at most 1.2e-4 above 0.4.
PRECISION = 1.2e-4


def paper_config(experiment: str, data, *overrides: str):
    """The experiment's TrainConfig with every required path set to ``data``."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", *overrides])
    fill_missing(cfg, str(data))
    return build(TrainConfig, cfg)


def sampled(text: str) -> Segment:
    return Segment("sampled", [0] * 5, [0.0] * 5, text)


def group(source: str) -> tuple[list[CloneTree], Task]:
    """One prompt's two trees: a correct root that spawned one well-formed clone, and a
    wrong root."""
    task = Task("t", "What is 3 + 4?", "7", source=source)
    good = CloneTree(task_id="t", task_index=0, sample_index=0)
    good.add(Node("0", None, 0, None, [1, 2], segments=[
        sampled('<tool_call>{"name": "spawn_clone"}</tool_call>'),
        Segment("return", [0], None, "7"),
        sampled("Answer: 7")], spawns=[Spawn(0, ["0.0"])], finish_reason="eos"))
    good.add(Node("0.0", "0", 1, "add 3 and 4", [1], segments=[sampled("Answer: 7")],
                  finish_reason="eos"))
    wrong = CloneTree(task_id="t", task_index=0, sample_index=1)
    wrong.add(Node("0", None, 0, None, [1, 2], segments=[sampled("Answer: 5")],
                   finish_reason="eos"))
    for tree in (good, wrong):  # what the engine decodes from each node's final turn
        for node in tree.nodes.values():
            node.final_text = node.last_turn_text()
            node.answer = node.final_text.removeprefix("Answer: ")
    return [good, wrong], task


@pytest.mark.parametrize("experiment", PAPER)
def test_each_paper_experiment_gives_clones_the_paper_codes_credit(experiment, tmp_path):
    assert set(SOURCES) == set(PAPER)
    config = paper_config(experiment, tmp_path)
    reward = build_reward(config)  # as the trainer builds it
    for source in SOURCES[experiment]:
        trees, task = group(source)
        score_trees(trees, [task], reward)
        assert trees[0].correct and not trees[1].correct
        advantages = compute_advantages(trees, config.algo.credit).per_tree[0]
        assert advantages["0"] > 0
        ratio = advantages["0.0"] / advantages["0"]
        assert ratio == pytest.approx(PAPER_RATIO[source], abs=PRECISION), (source, ratio)


def test_the_mixed_run_draws_aime_x3_math_hard_x2_arithmetic_x1(tmp_path):
    sizes = {"aime": 7, "math_hard": 5}
    for source, n in sizes.items():
        write_jsonl([Task(f"{source}-{i}", "q", "1", source=source) for i in range(n)],
                    tmp_path / f"{source}.jsonl")
    config = paper_config(
        "paper_mixed", tmp_path,
        *(f"task.params.sources.{s}.params.path={tmp_path}/{s}.jsonl" for s in sizes),
        "task.params.sources.arithmetic.params.n_train=11",  # 9000 in the run; fewer here
    )
    tasks = load_split(config.task, "train")
    expected = {"aime": 3 * 7, "math_hard": 2 * 5, "arithmetic": 1 * 11}
    assert Counter(task.source for task in tasks) == expected

    # One epoch of the trainer's sampler draws every copy once, whatever the step size.
    sampler = TaskSampler(tasks, config.trainer.seed)
    drawn = [task for _ in range(len(tasks) // 6) for task in sampler.take(6)]
    assert len(drawn) == len(tasks) and sampler.epoch == 0
    assert Counter(task.source for task in drawn) == expected
    assert Counter(task.id for task in drawn) == Counter(task.id for task in tasks)
