import json

import pytest
from reward_tree_builders import single_turn

from selfcest.rewards.gym import gym_reward
from selfcest.task import Task
from selfcest.tasks.gym import gym_tasks


@pytest.mark.parametrize("name", ["chain_sum", "family_relationships", "gsm_symbolic"])
def test_gym_scorer_uses_the_dataset(name):
    reward = gym_reward()
    for task in gym_tasks(name, size=3, seed=5):
        task = Task.from_dict(json.loads(json.dumps(task.to_dict())))  # as read from a file
        right = reward(single_turn(f"Let me think.\nAnswer: {task.answer}"), task)
        assert right.correct and right.score == 1.0
        wrong = reward(single_turn("Answer: definitely not this"), task)
        assert not wrong.correct and wrong.score < 1.0
        assert reward(single_turn(""), task).score == 0.0


def test_task_from_elsewhere_is_refused():
    with pytest.raises(ValueError, match="gym_tasks"):
        gym_reward()(single_turn("Answer: 1"), Task("t", "q", "1"))
