import math

import pytest
from reward_tree_builders import single_turn

from selfcest.rewards.arithmetic import IntegerScorer
from selfcest.rewards.base import RewardResult, load_reward, score_trees
from selfcest.rewards.compose import ComposedReward
from selfcest.task import Task

USER_REWARDS = '''
from selfcest.rewards.base import RewardResult

def constant(tree, task):
    return RewardResult(0.25, False, None, [], {"constant": 1.0})

def scaled(*, factor=1.0):
    def reward(tree, task):
        return RewardResult(factor, True)
    return reward

def broken_factory(*, factor=1.0):
    raise RuntimeError("no GPU here")

def wrong_arity(tree):
    return None

NOT_CALLABLE = 3
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_dotted_factory_with_and_without_arguments():
    reward = load_reward("selfcest.rewards.arithmetic:arithmetic_reward", {"partial_credit": True})
    assert isinstance(reward, ComposedReward) and reward.scorer == IntegerScorer(True)
    assert load_reward("selfcest.rewards.qa:qa_reward").scorer.metric == "em"


def test_file_path_reward_and_factory(rewards_file):
    constant = load_reward(f"{rewards_file}:constant")
    assert constant(None, None).score == 0.25
    assert load_reward(f"{rewards_file}:scaled", {"factor": 0.5})(None, None).score == 0.5


@pytest.mark.parametrize(
    "suffix, kwargs, reason",
    [
        (":constant", {"x": 1}, "takes no arguments"),
        (":scaled", {"nope": 1}, "neither takes"),
        (":broken_factory", None, "the factory raised RuntimeError: no GPU here"),
        (":wrong_arity", None, "neither takes"),
        (":NOT_CALLABLE", None, "neither takes"),
        (":missing", None, "has no attribute 'missing'"),
    ],
)
def test_file_path_failures_name_spec_and_reason(rewards_file, suffix, kwargs, reason):
    spec = f"{rewards_file}{suffix}"
    with pytest.raises(ValueError, match=reason) as error:
        load_reward(spec, kwargs)
    assert spec in str(error.value)


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("selfcest.rewards.arithmetic", "expected 'package.module:function'"),
        ("no_such_pkg.rewards:fn", "importing no_such_pkg.rewards raised ModuleNotFoundError"),
        ("selfcest.rewards.arithmetic:nope", "has no attribute 'nope'"),
        ("selfcest.rewards.compose:ComposedReward", "neither takes"),
        ("/no/such/file.py:fn", "no file"),
    ],
)
def test_dotted_failures(spec, reason):
    with pytest.raises(ValueError, match=reason):
        load_reward(spec)


def test_file_that_fails_to_execute(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def reward(tree, task):\n    return (\n")
    with pytest.raises(ValueError, match="executing .*bad.py raised SyntaxError"):
        load_reward(f"{path}:reward")


def test_score_trees_attaches_results():
    tasks = [Task("a", "q", "3"), Task("b", "q", "4")]
    trees = [single_turn("Answer: 3", task_id="a"), single_turn("Answer: 5", task_id="b")]
    trees[0].info["counterfactual"] = {"x": 1.0}  # set by someone else: kept
    reward = load_reward("selfcest.rewards.arithmetic:arithmetic_reward", {"cost": None})
    results = score_trees(trees, tasks, reward)
    assert [r.score for r in results] == [1.0, 0.0]
    assert (trees[0].reward, trees[0].correct, trees[1].correct) == (1.0, True, False)
    assert trees[0].node_rewards == {"0": 1.0}
    assert trees[0].info["malformed_nodes"] == [] and trees[0].info["task_score"] == 1.0
    assert trees[0].info["counterfactual"] == {"x": 1.0}
    score_trees(trees[:1], {"a": Task("a", "q", "4")}, reward)  # a mapping works too
    assert trees[0].reward == 0.0


def test_score_trees_never_silently_zeroes():
    tree = single_turn("Answer: 3", task_id="a")
    reward = load_reward("selfcest.rewards.arithmetic:arithmetic_reward")
    with pytest.raises(ValueError, match="no task with id 'a'"):
        score_trees([tree], [Task("b", "q", "3")], reward)
    with pytest.raises(ValueError, match="share the id"):
        score_trees([tree], [Task("a", "q", "3"), Task("a", "q", "4")], reward)

    def failing(tree, task):
        raise KeyError("oops")

    with pytest.raises(RuntimeError, match="failed on tree a#0"):
        score_trees([tree], [Task("a", "q", "3")], failing)
    with pytest.raises(ValueError, match="returned"):
        score_trees([tree], [Task("a", "q", "3")], lambda t, k: RewardResult(math.nan, False))
    assert tree.reward is None
