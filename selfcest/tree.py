"""Clone trees: what one rollout of one task produced, node by node.

A `CloneTree` is the unit that rewards score, advantages group and the trainer turns into
training samples. Each `Node` is one agent (the root, or a clone in a fresh context) and holds
its prompt tokens followed by an ordered list of `Segment`s:

- ``sampled``: tokens the backend generated for this node, with their per-token logprobs;
  the only trainable tokens;
- ``return``: the clones' answers injected after a spawn call;
- ``notice``: anything else the engine injects (protocol errors, budget notices, the
  chat-template glue around tool messages).

A node's full context is ``prompt_ids + concat(segment.token_ids)``, which is exactly the
token sequence its backend calls saw (token fidelity). Segments also carry their decoded
text, for humans and the trace viewer only; training reads token ids.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# sampled: the model's tokens; return: clones' results; notice: a failed call's error entry;
# prefill: tokens placed at the start of the root's turn by the caller (a forced style).
SegmentKind = Literal["sampled", "return", "notice", "prefill"]
FinishReason = Literal["eos", "budget", "error", "running"]


@dataclass
class Segment:
    """A run of tokens appended to a node's context, either sampled or injected."""

    kind: SegmentKind
    token_ids: list[int]
    # Per-token logprobs of sampled tokens under the sampling distribution; None if injected.
    logprobs: list[float] | None = None
    # Decoded text, for inspection only (never re-tokenised for training).
    text: str = ""

    @property
    def trainable(self) -> bool:
        return self.kind == "sampled"

    def __post_init__(self) -> None:
        if self.kind == "sampled":
            if self.logprobs is None or len(self.logprobs) != len(self.token_ids):
                raise ValueError("a sampled segment needs one logprob per token")
        elif self.logprobs is not None:
            raise ValueError(f"an injected {self.kind!r} segment carries no logprobs")


@dataclass
class Spawn:
    """One spawn call made by a node: which clones it started and which entries failed."""

    # Index in the parent's `segments` of the sampled segment that ended with the call.
    segment_index: int
    # Ids of the clones that ran, in objective order.
    child_ids: list[str]
    # One human-readable reason per refused objective (or one for a malformed call).
    errors: list[str] = field(default_factory=list)
    # One entry per objective, in order: the clone's id, or "" where the objective was
    # refused (its reason is the next entry of `errors`). Lets the results be re-rendered.
    slots: list[str] = field(default_factory=list)


@dataclass
class Node:
    """One agent in a clone tree: the root (depth 0) or a clone."""

    id: str  # a path: "0" is the root, "0.2" its third clone, "0.2.0" that clone's first
    parent_id: str | None
    depth: int
    objective: str | None  # the text the parent wrote; None for the root
    prompt_ids: list[int]
    context_keys: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    spawns: list[Spawn] = field(default_factory=list)
    finish_reason: FinishReason = "running"
    # The node's final turn as plain text: its sampled tokens after the last injected segment,
    # decoded without any special token of the tokenizer (so no EOS of any style, no
    # chat-template markup). Empty when that turn is a spawn call (finished or not): a node
    # cut off inside a call has no answer. Rewards read the root's from here.
    final_text: str = ""
    answer: str = ""  # the final answer: the `Answer:` line of final_text, else its last line
    error: str | None = None  # why the node failed, when finish_reason == "error"
    weight_version: int | None = None
    # Generation tokens this node was allowed (after every clamp), for inspection.
    generation_budget: int | None = None

    @property
    def children(self) -> list[str]:
        return [child for spawn in self.spawns for child in spawn.child_ids]

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.trainable)

    @property
    def injected_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if not s.trainable)

    @property
    def context_length(self) -> int:
        return len(self.prompt_ids) + sum(len(s.token_ids) for s in self.segments)

    def context_ids(self) -> list[int]:
        """The node's full token sequence: prompt followed by every segment."""
        ids = list(self.prompt_ids)
        for segment in self.segments:
            ids.extend(segment.token_ids)
        return ids

    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    def first_turn_ids(self) -> list[int]:
        """The tokens of the node's first turn (a prefill included): up to its first return
        or notice."""
        ids: list[int] = []
        for segment in self.segments:
            if segment.kind in ("return", "notice"):
                break
            ids += segment.token_ids
        return ids

    def last_turn_text(self) -> str:
        """Sampled text after the last injected segment: the node's final turn."""
        last: list[str] = []
        for segment in self.segments:
            last = [] if not segment.trainable else last + [segment.text]
        return "".join(last)


@dataclass
class TreeCosts:
    """Token accounting of one tree; every figure is in tokens except counts."""

    generated_tokens: int  # sampled by all nodes
    root_generated_tokens: int
    clone_generated_tokens: int
    context_tokens: int  # sum over nodes of their final context length (prompt + segments)
    # context_tokens less the root's prompt: what the tree cost beyond reading its task (every
    # clone's prompt, every node's generated tokens and every injected return and notice).
    processed_tokens: int
    critical_path_tokens: int  # sequential latency proxy, see `CloneTree.critical_path`
    clones: int
    depth: int  # deepest clone level reached (0: no clone)
    peak_context: int  # longest node context
    spawn_errors: int  # rejected objectives and malformed calls
    # Generated by the backend but in no node: completions discarded because the weights
    # changed during the rollout. generated_tokens + discarded_tokens is what was decoded.
    discarded_tokens: int = 0


@dataclass
class CloneTree:
    """All nodes of one rollout of one task, plus what the reward later attached."""

    task_id: str
    task_index: int  # position of the task in the rollout batch
    sample_index: int  # which of the `samples_per_task` trees of that task
    nodes: dict[str, Node] = field(default_factory=dict)
    weight_version: int | None = None
    reward: float | None = None
    correct: bool | None = None
    node_rewards: dict[str, float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # Tokens the backend generated for this tree that no node kept (see TreeCosts).
    discarded_tokens: int = 0

    ROOT_ID = "0"
    # The info key under which scoring lists the clones the reward found malformed
    # (`RewardResult.malformed`) and which the advantages' malformed gate reads.
    MALFORMED_KEY = "malformed_nodes"

    @property
    def root(self) -> Node:
        return self.nodes[self.ROOT_ID]

    @property
    def answer(self) -> str:
        return self.root.answer

    def add(self, node: Node) -> Node:
        if node.id in self.nodes:
            raise ValueError(f"duplicate node id {node.id}")
        if node.parent_id is not None and node.parent_id not in self.nodes:
            raise ValueError(f"node {node.id} has unknown parent {node.parent_id}")
        self.nodes[node.id] = node
        return node

    def clones(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.parent_id is not None]

    def critical_path(self, node_id: str | None = None) -> int:
        """Sequential latency proxy of a subtree, in generated tokens.

        A node's own generated tokens plus, for each of its spawn calls (waves, which run one
        after the other), the longest critical path among that wave's clones (which run
        concurrently).
        """
        node = self.nodes[node_id or self.ROOT_ID]
        waves = sum(
            max((self.critical_path(c) for c in spawn.child_ids), default=0)
            for spawn in node.spawns
        )
        return node.generated_tokens + waves

    def costs(self) -> TreeCosts:
        nodes = list(self.nodes.values())
        root = self.root
        generated = sum(n.generated_tokens for n in nodes)
        return TreeCosts(
            generated_tokens=generated,
            root_generated_tokens=root.generated_tokens,
            clone_generated_tokens=generated - root.generated_tokens,
            context_tokens=sum(n.context_length for n in nodes),
            processed_tokens=sum(n.context_length for n in nodes) - len(root.prompt_ids),
            critical_path_tokens=self.critical_path(),
            clones=len(nodes) - 1,
            depth=max(n.depth for n in nodes),
            peak_context=max(n.context_length for n in nodes),
            spawn_errors=sum(len(s.errors) for n in nodes for s in n.spawns),
            discarded_tokens=self.discarded_tokens,
        )

    # ----------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["nodes"] = [asdict(n) for n in self.nodes.values()]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CloneTree:
        data = dict(data)
        raw_nodes = data.pop("nodes")
        tree = cls(**data)
        for raw in raw_nodes:
            raw = dict(raw)
            raw["segments"] = [Segment(**s) for s in raw["segments"]]
            raw["spawns"] = [Spawn(**s) for s in raw["spawns"]]
            tree.add(Node(**raw))
        return tree

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> CloneTree:
        return cls.from_dict(json.loads(text))

    # ----------------------------------------------------------------- display

    def pretty(self, max_chars: int = 200) -> str:
        """An indented, human-readable rendering of the tree (text shortened to max_chars)."""
        costs = self.costs()
        head = f"tree {self.task_id}#{self.sample_index}"
        if self.reward is not None:
            head += f"  reward={self.reward:.3f} correct={self.correct}"
        head += (
            f"  generated={costs.generated_tokens} critical_path={costs.critical_path_tokens}"
            f" clones={costs.clones} depth={costs.depth}"
        )
        lines = [head]
        self._pretty_node(self.ROOT_ID, lines, max_chars)
        return "\n".join(lines)

    def _pretty_node(self, node_id: str, lines: list[str], max_chars: int) -> None:
        node = self.nodes[node_id]
        pad = "  " * (node.depth + 1)
        label = "root" if node.parent_id is None else f"clone {node.id}"
        lines.append(
            f"{pad}[{label}] {node.finish_reason}, {node.generated_tokens} generated, "
            f"context {node.context_length}, answer={_short(node.answer, 60)!r}"
        )
        if node.objective is not None:
            lines.append(f"{pad}  objective: {_short(node.objective, max_chars)!r}")
        if node.error:
            lines.append(f"{pad}  error: {node.error}")
        spawn_at = {s.segment_index: s for s in node.spawns}
        for i, segment in enumerate(node.segments):
            lines.append(f"{pad}  {segment.kind}: {_short(segment.text, max_chars)!r}")
            spawn = spawn_at.get(i)
            if spawn is not None:
                for error in spawn.errors:
                    lines.append(f"{pad}  spawn error: {error}")
                for child in spawn.child_ids:
                    self._pretty_node(child, lines, max_chars)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
