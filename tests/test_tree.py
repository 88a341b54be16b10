"""CloneTree: cost accounting, lossless JSON, pretty printing."""

from __future__ import annotations

import pytest

from selfcest.tree import CloneTree, Node, Segment, Spawn


def sampled(n: int, text: str = "x") -> Segment:
    return Segment("sampled", list(range(n)), [-0.25] * n, text)


def build_tree() -> CloneTree:
    """root: 5 tokens, spawns two clones (7 and 3 tokens; the 7-token one spawns a 4-token
    clone), then 2 more tokens after the return, then a second wave with one 6-token clone."""
    tree = CloneTree(task_id="t1", task_index=0, sample_index=1, reward=0.5, correct=True)
    root = tree.add(Node("0", None, 0, None, prompt_ids=[1] * 10))
    root.segments += [sampled(5, "<spawn>a<sep>b</spawn>"),
                      Segment("return", [9] * 4, None, "<return>..")]
    root.spawns.append(Spawn(0, ["0.0", "0.1"], ["bad key"]))
    root.segments += [sampled(2, "<spawn>c</spawn>"), Segment("return", [9] * 3)]
    root.spawns.append(Spawn(2, ["0.2"]))
    root.segments.append(sampled(1, "Answer: 4"))
    a = tree.add(Node("0.0", "0", 1, "a", prompt_ids=[1] * 6))
    a.segments += [sampled(7), Segment("return", [9] * 2), ]
    a.spawns.append(Spawn(0, ["0.0.0"]))
    tree.add(Node("0.0.0", "0.0", 2, "a1", prompt_ids=[1] * 3)).segments.append(sampled(4))
    tree.add(Node("0.1", "0", 1, "b", prompt_ids=[1] * 5)).segments.append(sampled(3))
    tree.add(Node("0.2", "0", 1, "c", prompt_ids=[1] * 5)).segments.append(sampled(6))
    return tree


def test_costs_are_hand_computed():
    costs = build_tree().costs()
    assert costs.root_generated_tokens == 5 + 2 + 1
    assert costs.clone_generated_tokens == 7 + 4 + 3 + 6
    assert costs.generated_tokens == 28
    # root 8 own + wave 1: max(clone 0.0 = 7 + 4, clone 0.1 = 3) + wave 2: 6
    assert costs.critical_path_tokens == 8 + 11 + 6
    assert costs.clones == 4 and costs.depth == 2
    # contexts: root 10+5+4+2+3+1=25, 0.0: 6+7+2=15, 0.0.0: 3+4=7, 0.1: 5+3=8, 0.2: 5+6=11
    assert costs.context_tokens == 25 + 15 + 7 + 8 + 11
    assert costs.processed_tokens == 25 + 15 + 7 + 8 + 11 - 10  # less the root's prompt
    assert costs.peak_context == 25
    assert costs.spawn_errors == 1


def test_json_round_trip_is_lossless():
    tree = build_tree()
    tree.root.segments[0].logprobs = [-0.1234567890123, -1e-12, -30.5, -0.0, -2.5]
    tree.node_rewards = {"0": 1.0, "0.1": 0.25}
    tree.info = {"malformed_nodes": ["0.2"]}
    again = CloneTree.from_json(tree.to_json())
    assert again == tree
    assert again.to_json() == tree.to_json()
    assert again.root.segments[0].logprobs[0] == -0.1234567890123


def test_last_turn_and_children():
    tree = build_tree()
    assert tree.root.last_turn_text() == "Answer: 4"
    assert tree.root.children == ["0.0", "0.1", "0.2"]
    assert tree.root.context_ids()[:10] == [1] * 10 and len(tree.root.context_ids()) == 25


def test_segments_validate_logprobs():
    with pytest.raises(ValueError, match="one logprob per token"):
        Segment("sampled", [1, 2], [0.0])
    with pytest.raises(ValueError, match="carries no logprobs"):
        Segment("return", [1], [0.0])
    assert not Segment("notice", [1]).trainable


def test_add_rejects_orphans_and_duplicates():
    tree = build_tree()
    with pytest.raises(ValueError, match="unknown parent"):
        tree.add(Node("0.9.0", "0.9", 2, "x", prompt_ids=[]))
    with pytest.raises(ValueError, match="duplicate"):
        tree.add(Node("0.1", "0", 1, "x", prompt_ids=[]))


def test_pretty_shows_the_hierarchy():
    text = build_tree().pretty()
    lines = text.splitlines()
    assert lines[
        0].startswith("tree t1#1  reward=0.500 correct=True  generated=28 critical_path=25")
    assert any(line.startswith("      [clone 0.0.0]") for line in lines)  # depth-2 indentation
    assert "spawn error: bad key" in text
    # the clones of a wave are listed right after the segment that spawned them
    assert text.index("[clone 0.1]") < text.index("return: '<return>..'")
