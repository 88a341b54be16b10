"""delegation_stats: spawn calls that parse, roots that delegate, clones right by the teacher."""

from __future__ import annotations

import copy
import math

import pytest

from selfcest.budget import Budget
from selfcest.eval.delegation import delegation_stats
from selfcest.policy import ClonePolicy
from selfcest.tasks import load_tasks
from selfcest.tasks.chain_sum_teacher import ChainSumTeacher
from selfcest.train.traces import teacher_trees

pytest.importorskip("reasoning_gym")

BUDGET = Budget(node_generation=160, node_context=1024, tree_generation=512, max_depth=1,
                clones_per_spawn=2, clones_per_tree=2, spawn_rounds=1, return_tokens=16)


@pytest.fixture(scope="module")
def protocol():
    return ClonePolicy.build_tiny(seed=0, protocol="tool").protocol


@pytest.fixture(scope="module")
def tasks():
    return load_tasks("gym", dataset="chain_sum", size=12, seed=0, min_terms=4, max_terms=4,
                      min_digits=1, max_digits=1)


class Sloppy:
    """ChainSumTeacher's turns, spoiled: every other root call loses its closing brace (and
    the root gives up after the error notice instead of repairing the call), and clones whose
    objective starts with an even, non-negative term add one to their answer."""

    def __init__(self) -> None:
        self.teacher = ChainSumTeacher(delegate=1.0)
        self.calls = 0

    def __call__(self, prompt: str) -> str:
        if "1: error: " in prompt:
            return "Answer: 0<|im_end|>"
        turn = self.teacher(prompt)
        if turn.startswith("<tool_call>"):
            self.calls += 1
            return turn.replace("]}}", "]}") if self.calls % 2 else turn
        if "user\nCompute " in prompt and "Compute -" not in prompt:
            first = int(prompt.split("user\nCompute ")[1].split()[0])
            if first % 2 == 0:
                answer = turn.rsplit("Answer: ", 1)[1].split("<")[0]
                return turn.replace(f"Answer: {answer}", f"Answer: {int(answer) + 1}")
        return turn


def test_a_faithful_teacher_scores_one_everywhere(protocol, tasks):
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0), protocol, BUDGET)
    stats = delegation_stats(trees, protocol, ChainSumTeacher())
    assert stats.roots == len(
        tasks) and stats.calls == len(tasks) and stats.clones == 2 * len(tasks)
    assert stats.parsed.value == stats.delegated.value == stats.clone_accuracy.value == 1.0


def test_malformed_calls_and_wrong_clones_are_counted(protocol, tasks):
    trees = teacher_trees(tasks, Sloppy(), protocol, BUDGET, correct_only=False)
    stats = delegation_stats(trees, protocol, ChainSumTeacher())
    malformed = sum(1 for t in trees if t.root.spawns and t.root.spawns[0].errors)
    assert malformed == len(tasks) // 2
    assert stats.calls == len(tasks) and stats.parsed.value == 0.5
    assert stats.delegated.value == 0.5  # a malformed call starts no clone
    clones = [c for t in trees for c in t.clones()]
    wrong = sum(1 for c in clones if int(c.objective.split()[1]) >= 0
                and int(c.objective.split()[1]) % 2 == 0)
    assert stats.clones == len(clones) and 0 < wrong < len(clones)
    assert stats.clone_accuracy.value == pytest.approx(1 - wrong / len(clones))
    assert stats.parsed.low < 0.5 < stats.parsed.high


def test_calls_are_resampled_by_tree(protocol, tasks):
    """The same 6 bad calls of 12, once one per tree, once all in one tree that retried: the
    fraction is the same, and the interval wider where one tree holds every failure (its
    calls are not independent draws)."""
    spread = teacher_trees(tasks, Sloppy(), protocol, BUDGET, correct_only=False)
    bad = [t for t in spread if t.root.spawns[0].errors]
    retried = copy.deepcopy(spread)
    keeper = next(t for t in retried if t.root.spawns[0].errors)
    for tree in retried:
        if tree.root.spawns[0].errors and tree is not keeper:
            calls = [s for s in tree.root.segments if s.trainable
                     and protocol.spawn_open_id in s.token_ids]
            keeper.root.segments += calls
            tree.root.segments = [s for s in tree.root.segments if s not in calls]
    one, other = (delegation_stats(trees, protocol, ChainSumTeacher())
                  for trees in (spread, retried))
    assert len(bad) == 6 and one.calls == other.calls == 12
    assert one.parsed.value == other.parsed.value == 0.5
    assert other.parsed.high - other.parsed.low > one.parsed.high - one.parsed.low


def test_no_calls_give_nan_fractions(protocol, tasks):
    no_spawning = Budget(**{**vars(BUDGET), "max_depth": 0})
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0), protocol, no_spawning)
    stats = delegation_stats(trees, protocol, ChainSumTeacher())
    assert stats.calls == 0 and math.isnan(stats.parsed.value)
    assert stats.delegated.value == 0.0 and stats.clones == 0
