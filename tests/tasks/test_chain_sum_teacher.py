"""ChainSumTeacher: correct chain_sum demonstrations in the tool-call protocol."""

from __future__ import annotations

import pytest

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.protocol import ProtocolError, ToolCallProtocol
from selfcest.tasks import load_tasks
from selfcest.tasks.chain_sum_teacher import (
    ChainSumTeacher,
    parse_chain,
    pieces,
    write_chain,
)
from selfcest.train.traces import teacher_trees

pytest.importorskip("reasoning_gym")

# The tiny tokenizer spells the tool description out in many tokens: a roomy budget.
BUDGET = Budget(node_generation=160, node_context=1024, tree_generation=512, max_depth=1,
                clones_per_spawn=2, clones_per_tree=2, spawn_rounds=1, return_tokens=16)


@pytest.fixture(scope="module")
def tool_policy() -> ClonePolicy:
    return ClonePolicy.build_tiny(seed=0, protocol="tool")


def chain_sums(n: int, seed: int = 0, **config) -> list:
    shape = {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 2, **config}
    return load_tasks("gym", dataset="chain_sum", size=n, seed=seed, **shape)


def test_chains_parse_write_and_halve():
    assert parse_chain(
        "State the final answer to the following arithmetic problem: 15 - 43 + 8 =") \
        == [15, -43, 8]
    assert parse_chain("Compute -75 + 8") == [-75, 8]
    assert parse_chain("Compute 5 + -3 - -2") == [5, -3, 2]
    assert parse_chain("Compute 7") == [7]
    assert write_chain([15, -43, 8]) == "15 - 43 + 8"
    assert write_chain([-75, 8]) == "-75 + 8"
    assert pieces([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert pieces([1, 2, 3, 4], 3) == [[1, 2], [3], [4]]
    assert pieces([1, 2, 3, 4, 5, 6], 3) == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="cannot cut 2 terms into 3 pieces"):
        pieces([1, 2], 3)


def test_demonstrations_are_right_and_delegating_roots_spawn_two_right_clones(tool_policy):
    tasks = chain_sums(40)
    teacher = ChainSumTeacher(delegate=0.5)
    trees = teacher_trees(tasks, teacher, tool_policy.protocol, BUDGET, correct_only=False)
    assert len(trees) == len(tasks)
    delegated = 0
    for tree in trees:
        task = tasks[tree.task_index]
        assert tree.answer == task.answer, tree.pretty()
        terms = parse_chain(task.prompt)
        clones = [tree.nodes[c] for c in tree.root.children]
        if not clones:
            assert tree.root.text().endswith("<|im_end|>")
            continue
        delegated += 1
        assert len(terms) >= teacher.min_delegate_terms
        # The root's first turn is a well-formed spawn_clone call with two objectives...
        requests = tool_policy.protocol.parse_text(tree.root.segments[0].text)
        assert [r.objective for r in requests] == [c.objective for c in clones]
        assert all(c.objective.startswith("Compute ") for c in clones)
        # ...over the two halves of the terms, which the clones sum correctly.
        assert [parse_chain(c.objective) for c in clones] == pieces(terms, 2)
        assert [int(c.answer) for c in clones] == [sum(h) for h in pieces(terms, 2)]
        assert not any(c.children for c in clones)  # clones never delegate
    assert 0 < delegated < len(trees)


def test_up_to_max_pieces_clones_whose_answers_the_root_adds(tool_policy):
    tasks = chain_sums(40, seed=5, min_terms=3)
    budget = Budget(**{**vars(BUDGET), "clones_per_spawn": 3, "clones_per_tree": 3})
    teacher = ChainSumTeacher(delegate=1.0, max_pieces=3)
    trees = teacher_trees(tasks, teacher, tool_policy.protocol, budget, correct_only=False)
    counts = set()
    for tree in trees:
        task = tasks[tree.task_index]
        terms = parse_chain(task.prompt)
        clones = [tree.nodes[c] for c in tree.root.children]
        counts.add(len(clones))
        assert [parse_chain(c.objective) for c in clones] == pieces(terms, len(clones))
        assert tree.answer == task.answer, tree.pretty()  # three answers added right too
    assert counts == {2, 3}


def test_short_chains_are_never_delegated_and_delegate_one_always_is(tool_policy):
    tasks = chain_sums(20, seed=3)
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0), tool_policy.protocol, BUDGET)
    assert len(trees) == len(tasks)
    for tree in trees:
        terms = parse_chain(tasks[tree.task_index].prompt)
        assert bool(tree.root.children) == (len(terms) >= 3)


def test_negated_terms_are_demonstrated_right(tool_policy):
    tasks = chain_sums(20, seed=7, allow_negation=True)
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=0.5), tool_policy.protocol, BUDGET)
    assert len(trees) == len(tasks)


def test_unreadable_prompts_raise_clear_errors():
    teacher = ChainSumTeacher()
    with pytest.raises(ValueError, match="no chain sum"):
        teacher("<|im_start|>user\nWhat is the capital of "
                "France?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no ChatML user message"):
        teacher("15 - 43 =")
    failed_clone = ("<|im_start|>user\nCompute 1 + 2 + 3<|im_end|>\n"
                    "<|im_start|>assistant\n<tool_call></tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n1: 3\n2: error: clone failed\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="not an integer"):
        teacher(failed_clone)
    with pytest.raises(ValueError, match="delegate must be a probability"):
        ChainSumTeacher(delegate=1.5)
    with pytest.raises(ValueError, match="repair must be a probability"):
        ChainSumTeacher(repair=-0.1)
    with pytest.raises(ValueError, match="max_pieces"):
        ChainSumTeacher(max_pieces=1)


def test_a_clone_solves_directly_with_one_operation_a_line():
    teacher = ChainSumTeacher(delegate=1.0)
    prompt = "<|im_start|>user\nCompute -75 + 8 - 3<|im_end|>\n<|im_start|>assistant\n"
    assert teacher(prompt) == "-75 + 8 = -67\n-67 - 3 = -70\nAnswer: -70<|im_end|>"
    assert ChainSumTeacher(end="</s>")(prompt).endswith("Answer: -70</s>")


def test_the_protocol_is_the_tool_protocol(tool_policy):
    assert isinstance(tool_policy.protocol, ToolCallProtocol)


def test_a_root_shown_no_tool_solves_directly(tool_policy):
    """With spawning off the root's prompt names no tool, so even delegate=1.0 solves
    directly (the monolithic twin's demonstrations, warm_start.direct_tasks)."""
    tasks = chain_sums(12, seed=5, min_terms=4)
    no_spawning = Budget(**{**vars(BUDGET), "max_depth": 0})
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0), tool_policy.protocol, no_spawning)
    assert len(trees) == len(tasks)
    for tree in trees:
        assert "spawn_clone" not in tool_policy.protocol.decode(tree.root.prompt_ids)
        assert not tree.root.children and tree.root.text().endswith("<|im_end|>")


def test_repair_demonstrations_write_a_malformed_call_then_the_right_one(tool_policy):
    """repair=1.0: every delegating root's first call is one of MALFORMED, the engine
    answers it with a notice, and the root's second call spawns the right clones; where
    spawn_rounds allows one call only, the repaired call is refused and the tree dropped."""
    tasks = chain_sums(30, seed=11, min_terms=3)
    two_calls = Budget(**{**vars(BUDGET), "spawn_rounds": 2})
    protocol = tool_policy.protocol
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0, repair=1.0), protocol, two_calls)
    assert len(trees) == len(tasks)
    reasons = set()
    for tree in trees:
        root = tree.root
        assert [s.kind for s in root.segments] == ["sampled", "notice", "sampled", "return",
                                                   "sampled"]
        first, repaired = protocol.parse_text(
            root.segments[0].text), protocol.parse_text(root.segments[2].text)
        # The notice names the error (cut to return_tokens like any returned text).
        assert isinstance(first,
                          ProtocolError) and "error: " + first.reason[:10] in root.segments[1].text
        reasons.add(first.reason.split(" ")[0])
        assert [r.objective for r in repaired] == [tree.nodes[c].objective for c in root.children]
        assert [len(s.child_ids) for s in root.spawns] == [0, 2]
    assert reasons == {"empty", "unknown", "invalid"}  # each form of MALFORMED was drawn
    assert teacher_trees(tasks, ChainSumTeacher(delegate=1.0, repair=1.0), protocol, BUDGET) == []

