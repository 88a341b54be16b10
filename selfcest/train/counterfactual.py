"""The re-runs counterfactual credit reads: each tree sampled again without one clone's answer."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from selfcest.algo.credit import COUNTERFACTUAL_KEY
from selfcest.rewards.base import RewardFn, score_trees
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tree import CloneTree


def counterfactual_reruns(trees: Sequence[CloneTree], tasks: Mapping[str, Task],
                          engine: RolloutEngine, reward_fn: RewardFn, config) -> None:
    """For each depth-1 clone, the mean reward of ``config.counterfactual_samples``
    (`CreditConfig`) re-runs of the root's continuation with that clone's answer replaced by a
    null result, stored in ``tree.info["counterfactual"]``.

    Simplification, stated: only the root's continuation is re-run; clones of clones take
    their depth-1 ancestor's value.
    """
    for tree in trees:
        task = tasks[tree.task_id]
        values = {}
        for clone_id in tree.root.children:
            reruns = engine.rerun_without(tree, task, clone_id,
                                          samples=config.counterfactual_samples)
            score_trees(reruns, {task.id: task}, reward_fn)
            values[clone_id] = statistics.fmean(t.reward for t in reruns)
        for node in tree.clones():
            if node.depth > 1:
                values[node.id] = values[".".join(node.id.split(".")[:2])]
        tree.info[COUNTERFACTUAL_KEY] = values
