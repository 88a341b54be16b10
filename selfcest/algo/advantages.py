"""Advantages and credit: from one global reward per tree to one advantage per node.

`compute_advantages(trees, config)` gates trees, groups them by prompt (GRPO), centres
and scales each tree's reward into a root advantage, lets a credit strategy
(`selfcest.algo.credit.CREDIT`) give every node an advantage, and zeroes malformed clones;
its docstring lists the stages and how advantages are scaled and bounded. Every gate reports
what it removed in ``Advantages.metrics``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from selfcest.algo.credit import CREDIT, malformed_clones, node_reward, tree_reward
from selfcest.configure import is_number, require, setting
from selfcest.tree import CloneTree

# Rewards closer than this count as equal for the zero-variance gate, so float noise from
# cost shaping (0.1 + 0.2 vs 0.3) does not keep a tied group alive.
_SAME_REWARD_ATOL = 1e-9


@dataclass
class CreditConfig:
    """How the global reward of each tree becomes an advantage for each of its nodes."""

    strategy: str = setting("broadcast", help=(
        "credit strategy: broadcast, ratio, sibling, counterfactual, or any name registered "
        "with selfcest.algo.credit.register_credit"))
    std_normalize: bool = setting(False, help=(
        "divide root advantages by the group's std + eps, and clone terms by their own spread "
        "(selfcest.algo.advantages, 'Scales and bounds'); off by default: with shaped rewards a "
        "group that differs only by small cost penalties gets those differences blown up to unit "
        "scale"))
    eps: float = setting(1e-6, help="added to every spread a term is divided by when std_normalize "
                                    "(the reference's 1e-6)")
    max_abs_advantage: float = setting(5.0, help="std_normalize: every advantage is clipped to "
                                                 "[-max_abs_advantage, max_abs_advantage]")
    ratio_clip: float = setting(1.5, help="ratio: the clone/root reward ratio is clipped to [0, "
                                          "ratio_clip] (the reference's 1.5)")
    ratio_smoothing: float = setting(0.1, help=(
        "ratio: added to both reward magnitudes, so the ratio is defined and continuous at a "
        "zero root reward (selfcest.algo.credit.reward_ratio); in reward units"))
    counterfactual_samples: int = setting(2, help="counterfactual: re-runs per clone with its "
                                                  "answer replaced by a null result")
    drop_zero_variance_groups: bool = setting(True, help="drop groups whose trees all have the "
                                                         "same reward (one-tree groups too)")
    zero_malformed_clones: bool = setting(True, help="set the advantage of clones in "
                                                     "tree.info['malformed_nodes'] to 0")
    drop_truncated_trees: bool = setting(False,
                                         help="drop trees in which any node finished with 'budget'")
    drop_error_trees: bool = setting(True, help="drop trees whose root finished with 'error'")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        require(self.strategy in CREDIT, "strategy",
                f"must be one of {', '.join(CREDIT)}; got {self.strategy!r}")
        for name in ("eps", "max_abs_advantage", "ratio_clip", "ratio_smoothing"):
            value = getattr(self, name)
            require(is_number(value) and math.isfinite(value) and value > 0, name,
                    f"must be a positive finite number; got {value!r}")
        require(is_number(self.counterfactual_samples) and self.counterfactual_samples >= 1,
                "counterfactual_samples", f"must be >= 1; got {self.counterfactual_samples!r}")
        for name in ("std_normalize", "drop_zero_variance_groups", "zero_malformed_clones",
                     "drop_truncated_trees", "drop_error_trees"):
            require(isinstance(getattr(self, name), bool), name,
                    f"must be true or false; got {getattr(self, name)!r}")


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
    """Group, gate and credit scored trees.

    It runs these stages, in this order:

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
    4. **Credit.** The strategy (`selfcest.algo.credit.CREDIT`) gives every node of the tree an
       advantage; the root always keeps ``A_i``. The clone terms of `sibling` and `counterfactual`
       are reward differences between clones, not between trees, so they get a scale of their own
       (see "Scales and bounds").
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

    rewards = {i: tree_reward(trees[i]) for members in groups.values() for i in members}
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

    strategy = CREDIT[config.strategy]
    per_tree: list[dict[str, float]] = [{} for _ in trees]
    fallbacks = clipped = 0
    for i, tree in enumerate(trees):
        if not keep[i]:
            continue
        a_root = root_advantage[i]
        credit = strategy.credit(tree, a_root, clone_terms.get(i, {}), config)
        if strategy.uses_node_rewards:
            fallbacks += sum(1 for n in tree.clones() if node_reward(tree, n.id, rewards[i])[1])
        malformed = malformed_clones(tree) if config.zero_malformed_clones else set()
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
    if strategy.uses_node_rewards:
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
    """Stage 3: group-relative root advantages of one group (`compute_advantages`)."""
    group_rewards = [rewards[i] for i in members]
    mean = math.fsum(group_rewards) / len(group_rewards)
    scale = 1.0
    if config.std_normalize and len(members) > 1:
        scale = statistics.stdev(group_rewards) + config.eps
    return {i: (rewards[i] - mean) / scale for i in members}


def _clone_terms(
    trees: Sequence[CloneTree], members: list[int], config: CreditConfig
) -> dict[int, dict[str, float]]:
    """The strategy's scaled clone terms for each tree of one group (none for a strategy
    without clone terms).

    Raw terms are reward differences (`selfcest.algo.credit`); with ``std_normalize`` they
    are divided by their own root mean square over the group plus eps (`compute_advantages`,
    "Scales and bounds").
    """
    clone_terms = CREDIT[config.strategy].clone_terms
    if clone_terms is None:
        return {}
    raw = {i: clone_terms(trees[i], config) for i in members}
    scale = 1.0
    if config.std_normalize:
        values = [v for terms in raw.values() for v in terms.values()]
        rms = math.sqrt(math.fsum(v * v for v in values) / len(values)) if values else 0.0
        scale = rms + config.eps
    return {i: {c: v / scale for c, v in terms.items()} for i, terms in raw.items()}


# --------------------------------------------------------------------- helpers


def is_truncated(tree: CloneTree) -> bool:
    """True if any node of the tree stopped because a budget ran out."""
    return any(node.finish_reason == "budget" for node in tree.nodes.values())


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
