import json

import pytest

from selfcest.task import Task
from selfcest.tasks.gym import gym_tasks


def test_gym_tasks_follow_the_dataset():
    import reasoning_gym

    tasks = gym_tasks("chain_sum", size=5, seed=3, min_terms=2, max_terms=3)
    dataset = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, min_terms=2, max_terms=3)
    for i, task in enumerate(tasks):
        assert task.prompt == dataset[i]["question"]
        assert task.answer == dataset[i]["answer"]
        assert task.metadata["gym_dataset"] == "chain_sum"
        assert task.metadata["gym_config"] == {"min_terms": 2, "max_terms": 3}
        assert task.metadata["gym_metadata"]["num_terms"] in (2, 3)
    assert [t.id for t in tasks][:2] == ["gym-chain_sum-3-0", "gym-chain_sum-3-1"]
    assert tasks[0].source == "gym/chain_sum"
    assert gym_tasks("chain_sum", size=5, seed=3, min_terms=2, max_terms=3) == tasks


def test_gym_metadata_is_json_safe():
    # gsm_symbolic keeps Fraction objects in its metadata (entry 7 of seed 0 has one).
    tasks = gym_tasks("gsm_symbolic", size=8, seed=0)
    assert tasks[7].metadata["gym_metadata"]["variables"]["serving_fraction"] == "2"
    for task in tasks:
        assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task


def test_unknown_dataset_or_config():
    with pytest.raises(ValueError, match="no_such_dataset"):
        gym_tasks("no_such_dataset", size=1)
    with pytest.raises(ValueError, match="chain_sum"):
        gym_tasks("chain_sum", size=1, no_such_field=3)
