"""Advantages and credit: from one global reward per tree to one advantage per node.

`compute_advantages(trees, config)` runs these stages, in this order:

1. **Tree gates.** A tree whose root finished with ``"error"`` is dropped
   (``drop_error_trees``): its reward scores the infrastructure (an overlong prompt, a failed
   backend call), not the policy. Optionally, a tree in which any node finished with
   ``"budget"`` is dropped (``drop_truncated_trees``). A dropped tree leaves its group
   *before* the group statistics are computed, so the trees that are trained on are centred
   among themselves.
2. **Groups.** A group is every remaining tree with the same ``task_index`` (all samples of
   one prompt, GRPO). A group whose rewards are all equal carries no learning signal for the
   global reward and is dropped when ``drop_zero_variance_groups`` (a one-tree group is such a
   group).
3. **Root advantage.** For tree i of group g, ``A_i = (R_i - mean_g R) / s_g`` with
   ``s_g = std_g + eps`` (unbiased std, as the reference) when ``std_normalize``, else
   ``s_g = 1``. A one-tree group gets ``A = 0``.
4. **Credit.** The strategy gives every node of the tree an advantage (see
   `broadcast_credit`, `ratio_credit`, `sibling_credit`, `counterfactual_credit`); the root
   always keeps ``A_i``. The clone terms of `sibling` and `counterfactual` are reward
   differences between clones, not between trees, so they get a scale of their own (see
   "Scales and bounds").
5. **Malformed gate.** Clones listed in ``tree.info["malformed_nodes"]`` get advantage 0
   (``zero_malformed_clones``): their output broke the format rule, so it is neither
   reinforced when the tree succeeded nor pushed around when it failed.

**Scales and bounds.** Without ``std_normalize`` every advantage is in reward units: a root
advantage is a difference of tree rewards, a sibling term a difference of clone rewards, a
counterfactual credit a difference of tree rewards; none exceeds the spread of the rewards
it compares. With ``std_normalize`` the root advantage of a group is divided by the spread of
that group's root rewards, and each clone term by the spread of the clone terms themselves:
``c_g = rms_g + eps``, the root mean square of the raw clone terms of all clones in group g.
Dividing a clone term by the root rewards' spread (as this module once did) mixed two
unrelated scales: two trees whose rewards differ by a 0.001 token cost gave their clones
advantages of ~1,400 whenever the clones' own rewards differed by 1. The root mean square
(not the std) keeps the zero of a term: a clone the tree did not need keeps credit 0.
A z-score is bounded by the group's size (``|A| <= sqrt(n)`` for n trees, or n clone terms),
so, to bound every advantage by one constant whatever the group sizes and rewards, the final
advantage of every node is clipped to ``[-max_abs_advantage, max_abs_advantage]`` when
``std_normalize`` (``adv/clipped_frac`` reports how often that binds; it never binds on the root
of a group of at most 26 trees). The constant: ``max_abs_advantage`` (default 5).

Every gate reports what it removed in ``Advantages.metrics``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from selfcest.tree import CloneTree

STRATEGIES = ("broadcast", "ratio", "sibling", "counterfactual")

# tree.info keys this module reads.
MALFORMED_KEY = "malformed_nodes"  # list of clone ids that broke the format rule
COUNTERFACTUAL_KEY = "counterfactual"  # clone id -> mean reward of the null-return re-runs

# Rewards closer than this count as equal for the zero-variance gate, so float noise from
# cost shaping (0.1 + 0.2 vs 0.3) does not keep a tied group alive.
_SAME_REWARD_ATOL = 1e-9


@dataclass
class CreditConfig:
    """How the global reward of each tree becomes an advantage for each of its nodes."""

    # Credit strategy: "broadcast", "ratio", "sibling" or "counterfactual" (see the
    # function of each name + "_credit").
    strategy: str = "broadcast"
    # Divide root advantages by the group's std + eps, and clone terms by their own spread
    # (module docstring, "Scales and bounds"). Off by default: one published ablation found
    # it hurts with shaped rewards, where a group that differs only by small cost penalties
    # gets those tiny differences blown up to unit scale.
    std_normalize: bool = False
    # Added to every spread a term is divided by when std_normalize (the reference's 1e-6).
    eps: float = 1e-6
    # std_normalize: every advantage is clipped to [-max_abs_advantage, max_abs_advantage].
    max_abs_advantage: float = 5.0
    # `ratio`: the clone/root reward ratio is clipped to [0, ratio_clip] (the reference's 1.5).
    ratio_clip: float = 1.5
    # `ratio`: delta added to both reward magnitudes, so the ratio is defined and continuous
    # at a zero root reward (see `reward_ratio`); in reward units.
    ratio_smoothing: float = 0.1
    # Drop groups whose trees all have the same reward (including one-tree groups).
    drop_zero_variance_groups: bool = True
    # Set the advantage of clones listed in tree.info["malformed_nodes"] to 0.
    zero_malformed_clones: bool = True
    # Drop trees in which any node finished with "budget".
    drop_truncated_trees: bool = False
    # Drop trees whose root finished with "error".
    drop_error_trees: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"credit.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        for name in ("eps", "max_abs_advantage", "ratio_clip", "ratio_smoothing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"credit.{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"credit.{name} must be a positive finite number, got {value!r}")
        for name in (
            "std_normalize",
            "drop_zero_variance_groups",
            "zero_malformed_clones",
            "drop_truncated_trees",
            "drop_error_trees",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"credit.{name} must be true or false, got {value!r}")


@dataclass
class Advantages:
    """Per-node advantages of one training step's trees, aligned with the input list."""

    # One dict per input tree: node id -> advantage, for every node; {} for a dropped tree.
    per_tree: list[dict[str, float]]
    # One flag per input tree: True if the tree is trained on.
    keep: list[bool]
    # Gate counts ("gate/..."), credit statistics ("credit/...") and advantage stats ("adv/...").
    metrics: dict[str, float]


def compute_advantages(trees: Sequence[CloneTree], config: CreditConfig) -> Advantages:
    """Group, gate and credit scored trees; see the module docstring for the stages."""
    metrics: dict[str, float] = {
        "gate/trees": float(len(trees)),
        "gate/error_trees": 0.0,
        "gate/truncated_trees": 0.0,
        "gate/zero_variance_groups": 0.0,
        "gate/zero_variance_trees": 0.0,
        "gate/malformed_clones": 0.0,
    }
    keep = _gate_trees(trees, config, metrics)
    groups: dict[int, list[int]] = {}
    for i, tree in enumerate(trees):
        if keep[i]:
            groups.setdefault(tree.task_index, []).append(i)

    rewards = {i: _tree_reward(trees[i]) for members in groups.values() for i in members}
    root_advantage: dict[int, float] = {}
    clone_terms: dict[int, dict[str, float]] = {}
    for members in groups.values():
        group_rewards = [rewards[i] for i in members]
        tied = max(group_rewards) - min(group_rewards) <= _SAME_REWARD_ATOL
        if tied and config.drop_zero_variance_groups:
            for i in members:
                keep[i] = False
            metrics["gate/zero_variance_groups"] += 1
            metrics["gate/zero_variance_trees"] += len(members)
            continue
        root_advantage.update(_root_advantages(members, rewards, config))
        clone_terms.update(_clone_terms(trees, members, config))

    per_tree: list[dict[str, float]] = [{} for _ in trees]
    fallbacks = clipped = 0
    for i, tree in enumerate(trees):
        if not keep[i]:
            continue
        a_root = root_advantage[i]
        if config.strategy == "broadcast":
            credit = broadcast_credit(tree, a_root)
        elif config.strategy == "ratio":
            credit = ratio_credit(tree, a_root, config.ratio_clip, config.ratio_smoothing)
        elif config.strategy == "sibling":
            credit = sibling_credit(tree, a_root, clone_terms[i])
        else:
            credit = counterfactual_credit(tree, a_root, clone_terms[i])
        if config.strategy in ("ratio", "sibling"):
            fallbacks += sum(1 for n in tree.clones() if _node_reward(tree, n.id, rewards[i])[1])
        malformed = _malformed_clones(tree) if config.zero_malformed_clones else set()
        for clone_id in malformed:
            credit[clone_id] = 0.0
        metrics["gate/malformed_clones"] += len(malformed)
        if config.std_normalize:
            bound = config.max_abs_advantage
            clipped += sum(1 for a in credit.values() if abs(a) > bound)
            credit = {n: min(bound, max(-bound, a)) for n, a in credit.items()}
        per_tree[i] = credit

    metrics.update(_advantage_stats(trees, per_tree, keep))
    nodes = sum(len(credit) for credit in per_tree)
    metrics["adv/clipped_frac"] = clipped / nodes if nodes else 0.0
    if config.strategy in ("ratio", "sibling"):
        clones = metrics["credit/clones"]
        metrics["credit/node_reward_fallback_frac"] = fallbacks / clones if clones else 0.0
    return Advantages(per_tree=per_tree, keep=keep, metrics=metrics)


def _gate_trees(trees: Sequence[CloneTree], config: CreditConfig, metrics: dict) -> list[bool]:
    """Stage 1: which trees may enter their group (error and truncation gates)."""
    keep = [True] * len(trees)
    for i, tree in enumerate(trees):
        if config.drop_error_trees and tree.root.finish_reason == "error":
            keep[i] = False
            metrics["gate/error_trees"] += 1
        elif config.drop_truncated_trees and is_truncated(tree):
            keep[i] = False
            metrics["gate/truncated_trees"] += 1
    return keep


def _root_advantages(
    members: list[int], rewards: dict[int, float], config: CreditConfig
) -> dict[int, float]:
    """Stage 3: group-relative root advantages of one group (module docstring)."""
    group_rewards = [rewards[i] for i in members]
    mean = math.fsum(group_rewards) / len(group_rewards)
    scale = 1.0
    if config.std_normalize and len(members) > 1:
        scale = statistics.stdev(group_rewards) + config.eps
    return {i: (rewards[i] - mean) / scale for i in members}


def _clone_terms(
    trees: Sequence[CloneTree], members: list[int], config: CreditConfig
) -> dict[int, dict[str, float]]:
    """The scaled clone terms of `sibling` or `counterfactual` for each tree of one group.

    Raw terms are reward differences (`sibling_differences`, `counterfactual_differences`);
    with ``std_normalize`` they are divided by their own root mean square over the group
    plus eps (module docstring, "Scales and bounds").
    """
    if config.strategy == "sibling":
        raw = {i: sibling_differences(trees[i]) for i in members}
    elif config.strategy == "counterfactual":
        skip = {i: _malformed_clones(trees[i]) if config.zero_malformed_clones else set()
                for i in members}
        raw = {i: counterfactual_differences(trees[i], skip[i]) for i in members}
    else:
        return {}
    scale = 1.0
    if config.std_normalize:
        values = [v for terms in raw.values() for v in terms.values()]
        rms = math.sqrt(math.fsum(v * v for v in values) / len(values)) if values else 0.0
        scale = rms + config.eps
    return {i: {c: v / scale for c, v in terms.items()} for i, terms in raw.items()}


# --------------------------------------------------------------------- credit strategies


def broadcast_credit(tree: CloneTree, root_advantage: float) -> dict[str, float]:
    """Every node gets its tree's root advantage: ``A_n = A_root``."""
    return {node_id: root_advantage for node_id in tree.nodes}


def reward_ratio(node_reward: float, root_reward: float, clip: float, smoothing: float) -> float:
    """The `ratio` strategy's share of the root advantage a node receives.

    ``w = min(c, (|R_n| + d) / (|R_root| + d))`` with ``c = clip`` and ``d = smoothing > 0``.

    The paper code uses ``R_n / s(R_root)`` clipped to [-c, c], with
    ``s(x) = sign(x) * max(|x|, 1e-8)``. That has two traps (docs/reference.md §2.5,
    §9.5), each avoided here:

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
    root_reward = _tree_reward(tree)
    credit = {CloneTree.ROOT_ID: root_advantage}
    for node in tree.clones():
        node_reward, _ = _node_reward(tree, node.id, root_reward)
        credit[node.id] = root_advantage * reward_ratio(node_reward, root_reward, clip, smoothing)
    return credit


def sibling_differences(tree: CloneTree) -> dict[str, float]:
    """Each clone's reward minus a leave-one-out baseline among the clones of its spawn call.

    For clone c started by spawn call S (``Spawn.child_ids``) with ``n = |S| >= 2`` clones::

        d_c = R_c - (sum_{j in S} R_j - R_c) / (n - 1)

    ``R_j`` is clone j's node reward (the tree reward when absent). The terms of one spawn
    call sum to zero. A clone alone in its call has no sibling to compare with and no entry.
    """
    root_reward = _tree_reward(tree)
    differences = {}
    for node in tree.nodes.values():
        for spawn in node.spawns:
            n = len(spawn.child_ids)
            if n < 2:
                continue
            values = {c: _node_reward(tree, c, root_reward)[0] for c in spawn.child_ids}
            total = math.fsum(values.values())
            for clone_id, value in values.items():
                differences[clone_id] = value - (total - value) / (n - 1)
    return differences


def sibling_credit(
    tree: CloneTree, root_advantage: float, terms: dict[str, float]
) -> dict[str, float]:
    """Root advantage plus a leave-one-out term among the clones of one spawn call.

    ``A_c = A_root + t_c``, with ``t_c`` clone c's `sibling_differences` entry, scaled as the
    module docstring says ("Scales and bounds"; 0 for a clone alone in its call). The first
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
    reward = _tree_reward(tree)
    return {c: reward - float(v) for c, v in counterfactual.items() if c not in skip}


def counterfactual_credit(
    tree: CloneTree, root_advantage: float, terms: dict[str, float]
) -> dict[str, float]:
    """Difference reward: ``A_c = t_c``, clone c's `counterfactual_differences` entry, scaled
    as the module docstring says ("Scales and bounds").

    A clone whose answer the tree did not need gets 0; one the tree's success depended on
    gets the full reward difference, whatever the other trees of the group did. A clone
    without a re-run (a skipped malformed clone) gets 0. The root keeps ``A_root``.
    """
    credit = {CloneTree.ROOT_ID: root_advantage}
    for node in tree.clones():
        credit[node.id] = terms.get(node.id, 0.0)
    return credit


# --------------------------------------------------------------------- helpers


def is_truncated(tree: CloneTree) -> bool:
    """True if any node of the tree stopped because a budget ran out."""
    return any(node.finish_reason == "budget" for node in tree.nodes.values())


def _tree_reward(tree: CloneTree) -> float:
    if tree.reward is None or not math.isfinite(tree.reward):
        raise ValueError(
            f"tree {tree.task_id}#{tree.sample_index} has reward {tree.reward!r}; "
            "score every tree with a finite reward before computing advantages"
        )
    return float(tree.reward)


def _node_reward(tree: CloneTree, node_id: str, fallback: float) -> tuple[float, bool]:
    """The node's own reward (or ``fallback`` if the reward gave none), and whether it fell back."""
    if tree.node_rewards is not None and node_id in tree.node_rewards:
        return float(tree.node_rewards[node_id]), False
    return fallback, True


def _malformed_clones(tree: CloneTree) -> set[str]:
    listed: Any = tree.info.get(MALFORMED_KEY, [])
    malformed = set(listed)
    clone_ids = {n.id for n in tree.clones()}
    if not malformed <= clone_ids:
        raise ValueError(
            f"tree.info[{MALFORMED_KEY!r}] of tree {tree.task_id}#{tree.sample_index} lists "
            f"{sorted(malformed - clone_ids)}, which are not clones of that tree"
        )
    return malformed


def _advantage_stats(
    trees: Sequence[CloneTree], per_tree: list[dict[str, float]], keep: list[bool]
) -> dict[str, float]:
    roots = [per_tree[i][CloneTree.ROOT_ID] for i in range(len(trees)) if keep[i]]
    clones = [
        per_tree[i][node.id] for i, tree in enumerate(trees) if keep[i] for node in tree.clones()
    ]
    stats = {
        "gate/kept_trees": float(len(roots)),
        "credit/clones": float(len(clones)),
        "credit/zero_advantage_clone_frac": (
            sum(1 for a in clones if a == 0.0) / len(clones) if clones else 0.0
        ),
    }
    for name, values in (("root", roots), ("clone", clones)):
        stats[f"adv/{name}_mean"] = statistics.fmean(values) if values else 0.0
        stats[f"adv/{name}_abs_mean"] = statistics.fmean(map(abs, values)) if values else 0.0
        stats[f"adv/{name}_std"] = statistics.pstdev(values) if values else 0.0
        stats[f"adv/{name}_min"] = min(values, default=0.0)
        stats[f"adv/{name}_max"] = max(values, default=0.0)
    return stats
