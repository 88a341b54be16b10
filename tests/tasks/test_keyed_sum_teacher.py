"""The keyed_sum teacher: correct demonstrations in both styles, built by the real engine."""

from __future__ import annotations

import pytest

from selfcest.budget import Budget
from selfcest.tasks.keyed_sum import KeyedSumConfig, inline_view, keyed_sum_tasks
from selfcest.tasks.keyed_sum_teacher import (
    KeyedSumTeacher,
    add_answers,
    running_sum,
    solve_lists,
    split_keys,
)
from selfcest.train.traces import teacher_trees

SHAPE = dict(list_len=3, max_value=3)
BIG = Budget(node_generation=512, tree_generation=4096, node_context=1024, max_depth=3,
             clones_per_spawn=8, clones_per_tree=32)


def test_running_sums_and_splits():
    assert running_sum([3, 5, 2]) == ("+3=3 +5=8 +2=10", 10)
    assert split_keys(["L1", "L2", "L3", "L4", "L5"], 2) == [["L1", "L2", "L3"], ["L4", "L5"]]
    assert split_keys(["L1"], 2) == [["L1"]]
    assert add_answers(["07", "11"], width=2,
                       answer_width=0) == "+07=07 +11=18\nAnswer: 18<|im_end|>"


def test_delegating_demonstrations_halve_the_keys_and_are_right_at_every_node(tiny_policy):
    tasks = keyed_sum_tasks(30, seed=0, config=KeyedSumConfig(num_keys=6, **SHAPE))
    trees = teacher_trees(tasks, KeyedSumTeacher(redelegate=0.5), tiny_policy.protocol, BIG)
    assert len(trees) == 30  # all correct, none dropped
    depths, leaf_sizes = set(), set()
    for tree, task in zip(trees, tasks):
        assert tree.answer == task.answer
        assert [len(tree.nodes[c].context_keys) for c in tree.root.children] == [3, 3]
        for node in tree.nodes.values():
            if node.id == tree.ROOT_ID:
                continue
            depths.add(node.id.count("."))
            if not node.children:
                leaf_sizes.add(len(node.context_keys))
            expected = sum(task.metadata["sums"][k] for k in node.context_keys)
            assert node.answer == f"{expected:02d}"  # clones answer zero-padded to two digits
    assert depths == {1, 2, 3} and leaf_sizes == {1, 2, 3}  # re-delegation is drawn per clone


def test_monolithic_demonstrations_sum_each_list_then_the_totals(tiny_policy):
    task = inline_view(keyed_sum_tasks(1, seed=4, config=KeyedSumConfig(num_keys=3, **SHAPE))[0])
    (tree,) = teacher_trees([task], KeyedSumTeacher(), tiny_policy.protocol, BIG)
    assert list(tree.nodes) == ["0"] and tree.answer == task.answer
    lines = tree.root.text().splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["L1", "L2", "L3"]
    assert lines[3].count("=") == 3  # the three list totals added up


def test_the_uninformed_teacher_delegates_by_chance_unless_the_lists_cannot_fit(tiny_policy):
    """Both styles where a node may solve directly, about half each, branching drawn from
    the list; delegation always above ``max_direct_keys``."""
    teacher = KeyedSumTeacher(branching=(2, 3, 4), redelegate=0.5, delegate_inline=0.5,
                              max_direct_keys=3)
    for keys in (3, 6):
        tasks = [inline_view(t) for t in keyed_sum_tasks(
            200, seed=keys, config=KeyedSumConfig(num_keys=keys, **SHAPE))]
        trees = teacher_trees(tasks, teacher, tiny_policy.protocol, BIG)
        assert all(tree.answer == task.answer for tree, task in zip(trees, tasks))
        delegated = [len(tree.root.children) for tree in trees if tree.root.children]
        for tree in trees:  # no node solves more than 3 lists itself
            assert all(node.children or len(node.context_keys) <= 3 for node in tree.clones())
        if keys == 3:
            assert 0.4 < len(delegated) / len(trees) < 0.6
            assert set(delegated) == {2, 3}  # 4 clones for 3 keys give one key each
        else:
            assert len(delegated) == len(trees) and set(delegated) == {2, 3, 4}


def test_the_teacher_refuses_what_it_cannot_demonstrate():
    with pytest.raises(ValueError, match="branching"):
        KeyedSumTeacher(branching=(1,))
    with pytest.raises(ValueError, match="redelegate"):
        KeyedSumTeacher(redelegate=1.5)
    with pytest.raises(ValueError, match="max_direct_keys"):
        KeyedSumTeacher(max_direct_keys=0)
    with pytest.raises(ValueError, match="direct_style"):
        KeyedSumTeacher(direct_style="scribble")


def test_the_copy_style_copies_each_list_then_keeps_one_running_total():
    lists = [("B", [0, 1, 3]), ("C", [3, 2, 1])]
    assert solve_lists(lists, style="copy") == ("B 0 1 3 +0=0 +1=1 +3=4\nC 3 2 1 +3=7 +2=9 "
                                                "+1=10\nAnswer: 10<|im_end|>")
    assert solve_lists(lists, style="copy", modulus=10) == (
        "B 0 1 3 +0=0 +1=1 +3=4\nC 3 2 1 +3=7 +2=9 +1=0\nAnswer: 0<|im_end|>")
    assert add_answers(["6", "7", "2"], style="copy",
                       modulus=10) == "6 7 2 +6=6 +7=3 +2=5\nAnswer: 5<|im_end|>"
    with pytest.raises(ValueError, match="copy style"):
        solve_lists(lists, modulus=10)


@pytest.mark.parametrize("inline", [False, True])
def test_modular_letter_key_demonstrations_are_right_at_every_node(tiny_policy, inline):
    shape = KeyedSumConfig(num_keys=5, modulus=10, letter_keys=True, inline=inline, **SHAPE)
    tasks = keyed_sum_tasks(20, seed=3, config=shape)
    assert tasks[0].prompt.startswith("Add all numbers" + ("" if inline else " in B C D E F")
                                      + " mod 10.")
    teacher = KeyedSumTeacher(branching=(2, 3), delegate_inline=0.5, redelegate=0.5,
                              direct_style="copy",
                              modulus=10, answer_width=1)
    trees = teacher_trees(tasks, teacher, tiny_policy.protocol, BIG)
    assert len(trees) == 20  # every demonstration right, none dropped
    for tree, task in zip(trees, tasks):
        for node in tree.clones():
            assert node.answer == str(sum(task.metadata["sums"][k] for k in node.context_keys) % 10)
    with pytest.raises(ValueError, match="modulus 0"):  # a teacher told the wrong modulus refuses
        KeyedSumTeacher()(f"<|im_start|>user\n{tasks[0].prompt}<|im_end|>\n<|im_start|>assistant\n")
