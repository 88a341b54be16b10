"""The worker process behind `selfcest.rewards.guard.RewardProcess`: a user's reward, run
where a hang can be cut off by killing it.

Run as ``python -m selfcest.rewards._reward_worker SPEC PARAMS_JSON`` (a
`selfcest.rewards.worker` process). It loads the reward as ``task.reward`` names it
(`load_reward`), then answers each JSON line ``{"tree": CloneTree.to_dict(), "task":
Task.to_dict()}`` with ``{"result": {score, correct, node_rewards, malformed, info}}``, or
``{"returned": repr}`` when the reward returned something other than a `RewardResult`.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import sys

from selfcest.rewards.base import RewardResult, load_reward
from selfcest.rewards.worker import serve
from selfcest.task import Task
from selfcest.tree import CloneTree

reward = None


def setup() -> None:
    global reward
    reward = load_reward(sys.argv[1], json.loads(sys.argv[2]))


def answer(request: dict) -> dict:
    result = reward(CloneTree.from_dict(request["tree"]), Task.from_dict(request["task"]))
    if not isinstance(result, RewardResult):
        return {"returned": repr(result)[:200]}
    fields = dataclasses.asdict(result)
    if isinstance(result.score, numbers.Real):  # a numpy scalar, say: JSON knows floats
        fields["score"] = float(result.score)
    return {"result": fields}


if __name__ == "__main__":
    serve(answer, setup)
