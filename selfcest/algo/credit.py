"""Credit strategies: how a tree's root advantage reaches each of its clones.

A strategy is a function registered with `register_credit` under the name
``algo.credit.strategy`` selects (the registry `CREDIT`). It gives every node an advantage
from the root's (`compute_advantages` computes that, group-relative) and, where it has them,
clone terms: reward differences between clones, which `compute_advantages` scales by their
own spread in the group (its docstring, "Scales and bounds"). Strategies are pure functions
of the scored trees: what ``counterfactual`` needs beyond them (each tree re-run without one
clone's answer) the trainer computes (`selfcest.train.counterfactual`).

- ``broadcast``: every node gets its tree's advantage.
- ``ratio``: the paper code's rule without its sign flip and zero division.
- ``sibling``: a leave-one-out baseline among the clones of one spawn call.
- ``counterfactual``: the difference reward of re-running the parent without one answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from selfcest.tree import CloneTree

# tree.info key the counterfactual strategy reads (malformed clones: CloneTree.MALFORMED_KEY).
COUNTERFACTUAL_KEY = "counterfactual"  # clone id -> mean reward of the null-return re-runs


def broadcast_credit(tree: CloneTree, root_advantage: float) -> dict[str, float]:
    """Every node gets its tree's root advantage: ``A_n = A_root``."""
    return {node_id: root_advantage for node_id in tree.nodes}


def reward_ratio(node_reward: float, root_reward: float, clip: float, smoothing: float) -> float:
    """The `ratio` strategy's share of the root advantage a node receives.

    ``w = min(c, (|R_n| + d) / (|R_root| + d))`` with ``c = clip`` and ``d = smoothing > 0``.

    The paper code uses ``R_n / s(R_root)`` clipped to [-c, c], with
    ``s(x) = sign(x) * max(|x|, 1e-8)``. That has two traps (docs/reference.md §2.5, §9.5), each
    avoided here:

    - *Sign flip.* When cost penalties push R_root below 0 while R_n stays positive, the
      ratio turns negative and the clone is pushed against its tree's outcome. Here both
      rewards enter as magnitudes, so ``w >= 0``: a node reward scales a clone's share of the
      tree's credit but never reverses it (direction signals between clones belong to the
      `sibling` strategy).
    - *Zero division and the discontinuity at R_root = 0.* There, 0/1e-8 gave clones of a
      reward-0 root no credit at all, while clones of a slightly penalised root got the full
      (or the clipped 1.5x) advantage. Here the denominator is at least d, so ``w`` is
      defined everywhere and continuous in both rewards; and ``w = 1`` whenever
      ``|R_n| = |R_root|``, at 0 as anywhere else, so a clone whose reward equals its root's
      (or that has no node reward) simply inherits the root advantage.

    Where the paper's ratio is well-defined (both rewards of one sign, ``|R_root| >> d``),
    ``w`` approaches it as d goes to 0; d trades fidelity there against steepness near 0.
    """
    return min(clip, (abs(node_reward) + smoothing) / (abs(root_reward) + smoothing))


def ratio_credit(
    tree: CloneTree, root_advantage: float, clip: float, smoothing: float
) -> dict[str, float]:
    """The paper code's rule without its traps: ``A_n = A_root * w(R_n, R_root)``.

    ``w`` is `reward_ratio`; ``R_root`` is the tree's global reward, ``R_n`` the node's own
    reward (``tree.node_rewards[n]``), falling back to ``R_root`` when absent (``w = 1``).
    Every clone, at any depth, is scaled against the root, as in the reference. The root
    keeps ``A_root``.
    """
    root_reward = tree_reward(tree)
    credit = {CloneTree.ROOT_ID: root_advantage}
    for node in tree.clones():
        reward, _ = node_reward(tree, node.id, root_reward)
        credit[node.id] = root_advantage * reward_ratio(reward, root_reward, clip, smoothing)
    return credit


def sibling_differences(tree: CloneTree) -> dict[str, float]:
    """Each clone's reward minus a leave-one-out baseline among the clones of its spawn call.

    For clone c started by spawn call S (``Spawn.child_ids``) with ``n = |S| >= 2`` clones::

        d_c = R_c - (sum_{j in S} R_j - R_c) / (n - 1)

    ``R_j`` is clone j's node reward (the tree reward when absent). The terms of one spawn
    call sum to zero. A clone alone in its call has no sibling to compare with and no entry.
    """
    root_reward = tree_reward(tree)
    differences = {}
    for node in tree.nodes.values():
        for spawn in node.spawns:
            n = len(spawn.child_ids)
            if n < 2:
                continue
            values = {c: node_reward(tree, c, root_reward)[0] for c in spawn.child_ids}
            total = math.fsum(values.values())
            for clone_id, value in values.items():
                differences[clone_id] = value - (total - value) / (n - 1)
    return differences


def sibling_credit(
    tree: CloneTree, root_advantage: float, terms: dict[str, float]
) -> dict[str, float]:
    """Root advantage plus a leave-one-out term among the clones of one spawn call.

    ``A_c = A_root + t_c``, with ``t_c`` clone c's `sibling_differences` entry, scaled as
    `compute_advantages` says ("Scales and bounds"; 0 for a clone alone in its call). The first
    term carries the global outcome to every clone (the tree did better or worse than its
    group); the second says whether this clone did better or worse than the clones started
    alongside it for the same parent, by the reward function's own measure. The terms of one
    spawn call sum to zero, so they move credit between siblings without changing the total.
    Without node rewards every clone gets the root advantage. Nested clones are compared
    with their own siblings and add the root advantage, not their parent's. The root keeps
    ``A_root``.
    """
    credit = broadcast_credit(tree, root_advantage)
    for clone_id, term in terms.items():
        credit[clone_id] = root_advantage + term
    return credit


def counterfactual_differences(tree: CloneTree, skip: Collection[str] = ()) -> dict[str, float]:
    """Difference reward of each clone: what the tree would lose without its return.

    ``d_c = R - R_cf(c)``, where R is the tree's global reward and ``R_cf(c) =
    tree.info["counterfactual"][c]`` the mean reward of K re-runs of the tree from c's spawn
    point with c's return replaced by a null result (the trainer does the re-runs and fills
    this in; a clone of a clone may be given its depth-1 ancestor's value, when only the
    root's continuation is re-run).

    Every clone needs an entry, except those in ``skip`` (malformed clones whose advantage
    is zeroed anyway, so the trainer may spare their re-runs), which get no difference.
    """
    clone_ids = [n.id for n in tree.clones()]
    needed = [c for c in clone_ids if c not in skip]
    where = f"tree {tree.task_id}#{tree.sample_index}"
    counterfactual = tree.info.get(COUNTERFACTUAL_KEY)
    if counterfactual is None and not needed:
        counterfactual = {}
    if not isinstance(counterfactual, dict):
        raise ValueError(
            f"credit strategy 'counterfactual' needs tree.info[{COUNTERFACTUAL_KEY!r}] "
            f"(clone id -> mean reward with that clone's return nulled); {where} has none"
        )
    missing = [c for c in needed if c not in counterfactual]
    unknown = sorted(set(counterfactual) - set(clone_ids))
    if missing or unknown:
        raise ValueError(
            f"tree.info[{COUNTERFACTUAL_KEY!r}] of {where} must have one entry per clone: "
            f"missing {missing}, unknown {unknown}"
        )
    reward = tree_reward(tree)
    return {c: reward - float(v) for c, v in counterfactual.items() if c not in skip}


def counterfactual_credit(
    tree: CloneTree, root_advantage: float, terms: dict[str, float]
) -> dict[str, float]:
    """Difference reward: ``A_c = t_c``, clone c's `counterfactual_differences` entry, scaled
    as `compute_advantages` says ("Scales and bounds").

    A clone whose answer the tree did not need gets 0; one the tree's success depended on
    gets the full reward difference, whatever the other trees of the group did. A clone
    without a re-run (a skipped malformed clone) gets 0. The root keeps ``A_root``.
    """
    credit = {CloneTree.ROOT_ID: root_advantage}
    for node in tree.clones():
        credit[node.id] = terms.get(node.id, 0.0)
    return credit


# --------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class CreditStrategy:
    """One way to credit clones (`register_credit` says what each field means)."""

    credit: Callable[[CloneTree, float, dict[str, float], Any], dict[str, float]]
    clone_terms: Callable[[CloneTree, Any], dict[str, float]] | None = None
    uses_node_rewards: bool = False
    needs_clones: bool = False
    reruns: bool = False


CREDIT: dict[str, CreditStrategy] = {}


def register_credit(name: str, *,
                    clone_terms: Callable[[CloneTree, Any], dict[str, float]] | None = None,
                    uses_node_rewards: bool = False, needs_clones: bool = False,
                    reruns: bool = False):
    """Register the decorated ``credit(tree, root_advantage, terms, config) -> {node id:
    advantage}`` as the strategy ``algo.credit.strategy=<name>`` selects.

    ``clone_terms(tree, config)``: the raw clone terms (reward differences) that
    `compute_advantages` scales and hands to ``credit`` as ``terms`` (None: ``terms`` is
    empty). ``uses_node_rewards``: it reads node rewards (how often a clone had none is
    reported). ``needs_clones``: it means nothing without clones (a run with spawning off is
    refused). ``reruns``: it reads ``tree.info["counterfactual"]``, which the trainer fills by
    re-running trees (`selfcest.train.counterfactual`), so every process needs an engine.
    """
    def register(credit: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
        if name in CREDIT:
            raise ValueError(f"credit strategy {name!r} is already registered")
        CREDIT[name] = CreditStrategy(credit, clone_terms, uses_node_rewards, needs_clones, reruns)
        return credit
    return register


@register_credit("broadcast")
def _broadcast(tree, root_advantage, terms, config) -> dict[str, float]:
    return broadcast_credit(tree, root_advantage)


@register_credit("ratio", uses_node_rewards=True)
def _ratio(tree, root_advantage, terms, config) -> dict[str, float]:
    return ratio_credit(tree, root_advantage, config.ratio_clip, config.ratio_smoothing)


def _sibling_terms(tree, config) -> dict[str, float]:
    return sibling_differences(tree)


@register_credit("sibling", clone_terms=_sibling_terms, uses_node_rewards=True, needs_clones=True)
def _sibling(tree, root_advantage, terms, config) -> dict[str, float]:
    return sibling_credit(tree, root_advantage, terms)


def _counterfactual_terms(tree, config) -> dict[str, float]:
    skip = malformed_clones(tree) if config.zero_malformed_clones else set()
    return counterfactual_differences(tree, skip)


@register_credit("counterfactual", clone_terms=_counterfactual_terms, needs_clones=True,
                 reruns=True)
def _counterfactual(tree, root_advantage, terms, config) -> dict[str, float]:
    return counterfactual_credit(tree, root_advantage, terms)


# --------------------------------------------------------------------- helpers


def tree_reward(tree: CloneTree) -> float:
    if tree.reward is None or not math.isfinite(tree.reward):
        raise ValueError(
            f"tree {tree.task_id}#{tree.sample_index} has reward {tree.reward!r}; "
            "score every tree with a finite reward before computing advantages"
        )
    return float(tree.reward)


def node_reward(tree: CloneTree, node_id: str, fallback: float) -> tuple[float, bool]:
    """The node's own reward (or ``fallback`` if the reward gave none), and whether it fell back."""
    if tree.node_rewards is not None and node_id in tree.node_rewards:
        return float(tree.node_rewards[node_id]), False
    return fallback, True


def malformed_clones(tree: CloneTree) -> set[str]:
    """The clones ``tree.info["malformed_nodes"]`` lists (which must be clones of the tree)."""
    listed: Any = tree.info.get(CloneTree.MALFORMED_KEY, [])
    malformed = set(listed)
    clone_ids = {n.id for n in tree.clones()}
    if not malformed <= clone_ids:
        raise ValueError(
            f"tree.info[{CloneTree.MALFORMED_KEY!r}] of tree {tree.task_id}#{tree.sample_index} "
            f"lists {sorted(malformed - clone_ids)}, which are not clones of that tree"
        )
    return malformed
