"""How well a policy delegates, read from sampled trees: do its spawn calls parse, does the
root delegate, and do its clones answer what they were asked?

Used after a warm start (`selfcest.experiments.cpu_repro`), where it says whether the model
learned the protocol before RL starts. Every figure is a fraction with a 95% bootstrap interval.
`DelegationStats` defines each fraction and how it is resampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from math import nan as NAN

from selfcest.eval.stats import Estimate, bootstrap_ratio
from selfcest.protocol import Protocol, ProtocolError, extract_answer
from selfcest.tree import CloneTree, Node


@dataclass
class DelegationStats:
    """Fractions over calls, roots and clones, with how many of each were counted.

    Roots are resampled one by one; calls and clones are resampled by tree, since the calls and
    clones of one tree are not independent (a root that writes a bad call and reads the error
    often retries it badly, and one tree can hold most of a split's failures):

    - ``parsed``: of the spawn calls the roots and clones wrote (a sampled turn that opened a
      call with the protocol's open token), the share that closed and parsed;
    - ``delegated``: of the roots, the share that started at least one clone;
    - ``clone_accuracy``: of the clones that answered, the share whose answer equals the one
      the teacher gives to the same clone prompt (the teacher plays the clone: a reference that
      exists for any objective the teacher can read; an objective it cannot read counts as wrong,
      one it would delegate again is not counted).

    A fraction with nothing to count (no call was written) is NaN, its count 0.
    """

    parsed: Estimate
    delegated: Estimate
    clone_accuracy: Estimate
    calls: int
    roots: int
    clones: int

    def to_dict(self) -> dict:
        return asdict(self)


def call_turns(node: Node, protocol: Protocol) -> tuple[int, int]:
    """(calls opened, calls that parsed) in the node's sampled turns."""
    opened = parsed = 0
    for segment in node.segments:
        if segment.trainable and protocol.spawn_open_id in segment.token_ids:
            opened += 1
            closed = segment.token_ids[-1] == protocol.spawn_stop_id
            parsed += closed and not isinstance(protocol.parse(segment.token_ids), ProtocolError)
    return opened, parsed


def delegation_stats(trees: Sequence[CloneTree], protocol: Protocol, teacher: Callable[[str], str],
                     resamples: int = 1000, seed: int = 0) -> DelegationStats:
    """The three fractions of `DelegationStats` over ``trees``."""
    calls: list[tuple[int, int]] = []  # per tree with calls: (calls that parsed, calls opened)
    clones: list[tuple[int, int]] = []  # per tree with counted clones: (right, counted)
    for tree in trees:
        opened = parsed = 0
        for node in tree.nodes.values():
            node_opened, node_parsed = call_turns(node, protocol)
            opened, parsed = opened + node_opened, parsed + node_parsed
        if opened:
            calls.append((parsed, opened))
        right = counted = 0
        for clone in tree.clones():
            if clone.finish_reason == "error":
                continue
            reference = _teacher_answer(teacher, protocol, clone)
            if reference is not _DELEGATES:
                right, counted = right + (reference == clone.answer), counted + 1
        if counted:
            clones.append((right, counted))
    roots = [(int(bool(tree.root.children)), 1) for tree in trees]  # a root is its own group

    def fraction(groups: list[tuple[int, int]]) -> Estimate:
        if not groups:
            return Estimate(NAN, NAN, NAN)
        hits, items = zip(*groups)
        return bootstrap_ratio(hits, items, resamples, seed=seed)

    return DelegationStats(
        parsed=fraction(calls), delegated=fraction(roots), clone_accuracy=fraction(clones),
        calls=sum(n for _, n in calls), roots=len(roots), clones=sum(n for _, n in clones),
    )


_DELEGATES = object()  # the teacher would delegate this clone's objective again


def _teacher_answer(teacher: Callable[[str], str], protocol: Protocol, clone: Node):
    """The answer the teacher writes in the clone's place (its turn ends with end-of-turn
    text, which `Protocol.final_text` drops as the engine does for a sampled turn)."""
    try:
        turn = teacher(protocol.decode(clone.prompt_ids))
    except ValueError:
        return None
    final = protocol.final_text(protocol.encode(turn))
    return extract_answer(final) if final else _DELEGATES
