import pytest
from reward_tree_builders import node, returned, said, single_turn, tree_of

from selfcest.budget import Budget
from selfcest.rewards.arithmetic import arithmetic_reward
from selfcest.rewards.base import TaskScore
from selfcest.rewards.compose import make_reward, malformed_clones
from selfcest.rewards.cost import CostConfig
from selfcest.task import Task
from selfcest.tasks.keyed_sum import KeyedSumConfig, keyed_sum_tasks
from selfcest.tasks.keyed_sum_teacher import KeyedSumTeacher
from selfcest.train.traces import teacher_trees
from selfcest.tree import Spawn

TASK = Task("t", "q", "7")


def exact(text, task):
    """A scorer for the tests: the final turn must be exactly "Answer: <answer>"."""
    ok = text.strip() == f"Answer: {task.answer}"
    return TaskScore(float(ok), ok, {"seen_chars": float(len(text))})


def tree_with_clones(*clones):
    """Root spawns one wave with the given (text, tokens) clones, then answers 7."""
    ids = [f"0.{i}" for i in range(len(clones))]
    root = node("0", [said("<spawn>x</spawn>", 10), returned("..."), said("Answer: 7", 4)],
                [Spawn(0, ids)])
    return tree_of(root, *(node(i, [said(text, n)]) for i, (text, n) in zip(ids, clones)))


def test_format_rule_threshold():
    tree = tree_with_clones(
        ("thinking without end", 193), ("thinking without end", 192),
        ("long work... ANSWER : 3", 500), ("long work, answer: 3", 500),
    )
    assert malformed_clones(tree) == ["0.0"]
    assert malformed_clones(tree, max_tokens_without_answer=100) == ["0.0", "0.1"]
    # The root is never checked, however long and answerless it is.
    assert malformed_clones(single_turn("no answer", tokens=5000)) == []


def test_composed_reward():
    tree = tree_with_clones(("Answer: 3", 20), ("rambling", 400))
    reward = make_reward(exact, CostConfig(root_length=None, spawn_calls=None, per_clone=0.05),
                         clone_scale=0.4)
    result = reward(tree, TASK)
    assert result.correct and result.score == pytest.approx(0.9)
    assert result.malformed == ["0.1"]
    assert result.node_rewards == pytest.approx({"0": 0.9, "0.0": 0.36, "0.1": 0.0})
    assert result.info == pytest.approx({
        "task_score": 1.0, "seen_chars": 9.0, "cost/clone_length": 0.0, "cost/clones": 0.1,
        "cost/total": 0.1,
    })


def test_correct_is_unshaped_and_shaping_applies_to_wrong_answers():
    reward = make_reward(exact, CostConfig(root_length=None, spawn_calls=None, per_token=0.001))
    right = reward(single_turn("Answer: 7", tokens=400), TASK)
    wrong = reward(single_turn("Answer: 8", tokens=400), TASK)
    assert right.correct and right.score == pytest.approx(0.6)
    assert not wrong.correct and wrong.score == pytest.approx(-0.4)


def test_scorer_sees_the_final_turn_without_template_tokens():
    root = node("0", [said("Answer: 7 <spawn>a</spawn>"), returned("7"),
                      said("Answer: 7<|im_end|>")], [Spawn(0, ["0.0"])])
    tree = tree_of(root, node("0.0", [said("Answer: 7")]))
    result = make_reward(exact)(tree, TASK)
    assert result.correct and result.info["seen_chars"] == len("Answer: 7")


def test_options_off():
    tree = tree_with_clones(("rambling", 400))
    result = make_reward(exact, None, format_tokens=None)(tree, TASK)
    assert result.malformed == [] and result.node_rewards == {"0": 1.0, "0.0": 1.0}
    assert result.info == {"task_score": 1.0, "seen_chars": 9.0, "cost/total": 0.0}


def test_cost_given_as_a_mapping():
    reward = make_reward(exact, {"root_length": None, "spawn_calls": None, "per_clone": 0.5})
    assert reward(tree_with_clones(("Answer: 1", 5)), TASK).score == pytest.approx(0.5)


def test_own_clone_rewards_score_each_clone_on_the_keys_it_was_handed(tiny_policy):
    """A keyed_sum tree the teacher solved, one clone's answer then made wrong: with
    clone_reward="own" that clone alone gets 0; with "tree" every clone gets the tree's score."""
    (task,) = keyed_sum_tasks(1, seed=3, config=KeyedSumConfig(num_keys=4, list_len=3, max_value=3))
    budget = Budget(node_generation=256, tree_generation=2048, node_context=512, max_depth=2)
    (tree,) = teacher_trees([task], KeyedSumTeacher(branching=(4,)), tiny_policy.protocol, budget)
    wrong = tree.clones()[1]
    wrong.final_text = "Answer: 99"
    own = arithmetic_reward(cost=None, clone_reward="own")(tree, task)
    shared = arithmetic_reward(cost=None)(tree, task)
    assert own.score == shared.score == 1.0
    assert {n: r for n, r in own.node_rewards.items() if r != 1.0} == {wrong.id: 0.0}
    assert set(shared.node_rewards.values()) == {1.0}
    with pytest.raises(ValueError, match="clone_reward"):
        arithmetic_reward(clone_reward="mine")


def test_own_clone_rewards_score_chain_sum_clones_on_their_objectives():
    """Clones of a reasoning-gym chain_sum task: a clone is right when it adds up what its
    objective says (whether or not that was a fair cut of the task); an objective with no
    chain sum falls back to the tree's score."""
    pytest.importorskip("reasoning_gym")
    from selfcest.tasks import load_tasks

    (task,) = load_tasks("gym", dataset="chain_sum", size=1, seed=0, min_terms=4, max_terms=4)
    tree = tree_with_clones(("3", 2), ("Answer: 8", 3), ("Answer: 5", 3))
    for clone, objective in zip(tree.clones(),
                                ["Compute 1 + 2", "Compute 3 + 4 + 1", "add the rest"]):
        clone.objective = objective
    rewards = arithmetic_reward(cost=None, clone_reward="own")(tree, task).node_rewards
    assert [rewards[c.id] for c in tree.clones()] == [1.0, 1.0, rewards["0"]]
    tree.clones()[1].final_text = "Answer: 7"
    assert arithmetic_reward(cost=None, clone_reward="own")(tree, task).node_rewards["0.1"] == 0.0
