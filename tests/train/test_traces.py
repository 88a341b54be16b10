"""Teacher demonstrations through the real engine: cut ones dropped, held-out tasks left out."""

from __future__ import annotations

import pytest

from selfcest.budget import Budget
from selfcest.tasks import load_tasks
from selfcest.tasks.keyed_sum import KeyedSumConfig, inline_view, keyed_sum_tasks
from selfcest.tasks.keyed_sum_teacher import KeyedSumTeacher
from selfcest.train.config import TaskSourceConfig
from selfcest.train.traces import demonstrations, teacher_trees

SHAPE = dict(list_len=3, max_value=3)
BIG = Budget(node_generation=512, tree_generation=4096, node_context=1024, max_depth=3,
             clones_per_spawn=8, clones_per_tree=32)


def test_a_demonstration_cut_by_its_budget_is_dropped(tiny_policy):
    tasks = keyed_sum_tasks(5, seed=1, config=KeyedSumConfig(num_keys=4, **SHAPE))
    shallow = Budget(node_generation=512, tree_generation=4096, node_context=1024, max_depth=1)
    teacher = KeyedSumTeacher(redelegate=1.0)  # 4 keys -> 2 -> 1: depth 2
    assert teacher_trees(tasks, teacher, tiny_policy.protocol, shallow) == []
    assert len(teacher_trees(tasks, teacher, tiny_policy.protocol, shallow,
                             correct_only=False)) == 5


def test_demonstrations_from_a_config_leave_held_out_tasks_out(tiny_policy):
    params = {"split": "train", "n_train": 40, "n_test": 0, "n_ood": 0,
              "train": {"num_keys": 2, **SHAPE}}
    source = TaskSourceConfig("keyed_sum", params)
    tasks = load_tasks("keyed_sum", **params)
    held_out = [inline_view(task) for task in tasks[:10]]  # the same lists, shown inline
    trees = demonstrations(source, "keyed_sum", {}, tiny_policy.protocol, BIG, exclude=held_out)
    assert sorted(tree.task_id for tree in trees) == sorted(task.id for task in tasks[10:])
    with pytest.raises(ValueError, match="unknown teacher"):
        demonstrations(source, "nope", {}, tiny_policy.protocol, BIG)
    no_clones = Budget(node_generation=512, tree_generation=4096, node_context=1024, max_depth=0)
    with pytest.raises(ValueError, match="fit warm_start.budget"):
        demonstrations(source, "keyed_sum", {}, tiny_policy.protocol, no_clones)
