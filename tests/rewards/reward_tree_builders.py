"""Hand-built clone trees for reward tests (token ids are dummies; counts are what matter)."""

from __future__ import annotations

import re

from selfcest.protocol import extract_answer
from selfcest.tree import CloneTree, Node, Segment, Spawn


def said(text: str, tokens: int = 5) -> Segment:
    """A sampled segment of ``tokens`` tokens whose decoded text is ``text``."""
    return Segment("sampled", list(range(tokens)), [0.0] * tokens, text)


def returned(text: str) -> Segment:
    """An injected return segment (clone answers)."""
    return Segment("return", [0, 1], None, text)


# What the engine's decode without special tokens removes from these hand-written texts.
_SPECIAL = re.compile(r"<\|im_end\|>|<spawn>.*|</?return>|<sep>", re.DOTALL)


def node(node_id: str, segments: list[Segment], spawns: list[Spawn] = ()) -> Node:
    """A finished node; its final text is what `RolloutEngine` would decode from its last turn."""
    parent = None if node_id == "0" else node_id.rsplit(".", 1)[0]
    result = Node(
        id=node_id,
        parent_id=parent,
        depth=node_id.count("."),
        objective=None if parent is None else f"objective of {node_id}",
        prompt_ids=[0, 1, 2],
        segments=list(segments),
        spawns=list(spawns),
        finish_reason="eos",
    )
    final = result.last_turn_text()
    result.final_text = "" if "<spawn>" in final else _SPECIAL.sub("", final)
    result.answer = extract_answer(result.final_text)
    return result


def tree_of(*nodes: Node, task_id: str = "t") -> CloneTree:
    tree = CloneTree(task_id=task_id, task_index=0, sample_index=0)
    for n in nodes:
        tree.add(n)
    return tree


def single_turn(text: str, tokens: int = 5, task_id: str = "t") -> CloneTree:
    """A root that answered in one turn and spawned nothing."""
    return tree_of(node("0", [said(text, tokens)]), task_id=task_id)
