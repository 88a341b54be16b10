"""A reward that routes each task to the reward of its source (for mixed-task runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from selfcest.rewards.base import RewardFn, RewardResult, load_reward
from selfcest.task import Task
from selfcest.tree import CloneTree


def routed_reward(*, routes: Mapping[str, Mapping[str, Any]], default: str
                  | None = None) -> RewardFn:
    """``routes`` maps a task source (``Task.source``) to ``{"reward": spec, "params": {...}}``.

    Every route is loaded up front (a bad spec fails before any rollout). A task whose source
    has no route uses the route named ``default``; without one it is an error, never a zero.
    """
    loaded = {
        source: load_reward(route["reward"], route.get("params")) for source,
        route in routes.items()
    }
    if default is not None and default not in loaded:
        raise ValueError(f"default route {default!r} is not one of {sorted(loaded)}")

    def reward(tree: CloneTree, task: Task) -> RewardResult:
        source = task.source if task.source in loaded else default
        if source is None:
            raise ValueError(f"no reward route for task source {task.source!r}; routes: "
                             f"{sorted(loaded)}")
        return loaded[source](tree, task)

    return reward
