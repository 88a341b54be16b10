"""routed_reward sends each task to its source's reward."""

from __future__ import annotations

import pytest

from selfcest.rewards.router import routed_reward
from selfcest.task import Task
from selfcest.tree import CloneTree, Node, Segment


def tree_answering(text: str) -> CloneTree:
    tree = CloneTree("t", 0, 0)
    node = tree.add(Node("0", None, 0, None, prompt_ids=[1]))
    node.segments.append(Segment("sampled", [1, 2], [0.0, 0.0], f"Answer: {text}"))
    node.final_text, node.answer = f"Answer: {text}", text
    return tree


def test_routes_by_source_and_fails_loudly_without_a_route():
    reward = routed_reward(routes={
        "arithmetic": {"reward": "selfcest.rewards.arithmetic:arithmetic_reward",
                       "params": {"cost": None}},
        "2wiki": {"reward": "selfcest.rewards.qa:qa_reward", "params": {"cost": None}},
    })
    assert reward(tree_answering("1,234"), Task("a", "q", "1234", source="arithmetic")).correct
    assert reward(tree_answering("The Paris."), Task("b", "q", "paris", source="2wiki")).correct
    with pytest.raises(ValueError, match="no reward route for task source 'aime'"):
        reward(tree_answering("3"), Task("c", "q", "3", source="aime"))
    with pytest.raises(ValueError, match="reward spec"):
        routed_reward(routes={"x": {"reward": "no.such:thing"}})
