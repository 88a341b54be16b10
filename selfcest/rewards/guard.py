"""Rewards a run survives: a user's reward that fails on a tree costs that tree, not the run.

`GuardedReward` wraps any reward. A call that raises, returns something other than a
`RewardResult`, or a score or node reward that is not a finite number scores the tree 0,
sets ``info["errors"] = 1`` (logged as ``reward/errors``, the share of a step's trees) and
records why in ``failures``; so no NaN reaches the advantages. `RewardProcess` runs a reward
named by its spec in a worker process with a time limit per call (``task.reward_timeout_s``):
a call past it kills the worker (a fresh one serves the next call) and the guard scores
the tree 0 with ``info["timeouts"] = 1`` (``reward/timeouts``). The trainer stops a run when
every reward of a step failed (`selfcest.train.trainer.GRPOTrainer`).

Without a timeout the reward runs in this process at the cost of one function call: tiny
rewards run thousands of times a step.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from selfcest.rewards.base import RewardFn, RewardResult
from selfcest.rewards.worker import LineWorker, WorkerLost, WorkerStartError, WorkerTimeout
from selfcest.task import Task
from selfcest.tree import CloneTree


class RewardTimeout(Exception):
    """A reward call ran past its time limit and was cut off."""


class RewardFailed(Exception):
    """The reward raised in its worker process; the message is ``<type>: <message>``."""


class RewardProcess:
    """The reward ``spec`` names (with factory ``params``), called in a worker process, at
    most ``timeout_s`` seconds a call (`RewardTimeout` past it). Its stderr is this
    process's, so what the reward prints is seen."""

    def __init__(self, spec: str, params: Mapping[str, Any] | None, timeout_s: float,
                 startup_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._worker = LineWorker("selfcest.rewards._reward_worker",
                                  (spec, json.dumps(dict(params or {}))),
                                  startup_timeout_s=startup_timeout_s, stderr=None)

    def __call__(self, tree: CloneTree, task: Task) -> RewardResult:
        try:
            response = self._worker.ask({"tree": tree.to_dict(), "task": task.to_dict()},
                                        self.timeout_s)
        except WorkerTimeout:
            raise RewardTimeout(f"the reward took over {self.timeout_s:g} s "
                                "(task.reward_timeout_s) and was cut off; its worker "
                                "restarts") from None
        except WorkerLost as error:
            raise RewardFailed(f"the reward's worker process died ({error}); it restarts") from None
        if "failed" in response:
            raise RewardFailed(response["failed"])
        if "returned" in response:
            raise TypeError(f"returned {response['returned']}, not a RewardResult")
        return RewardResult(**response["result"])

    def close(self) -> None:
        self._worker.close()


class GuardedReward:
    """``reward`` that never raises for one tree and never returns a non-finite score (see
    the module doc); ``failures`` lists why each failed tree failed, until cleared."""

    def __init__(self, reward: RewardFn) -> None:
        self.reward = reward
        self.failures: list[str] = []

    def __call__(self, tree: CloneTree, task: Task) -> RewardResult:
        try:
            result = self.reward(tree, task)
        except WorkerStartError:  # no call could succeed: not one tree's failure
            raise
        except RewardTimeout as error:
            return self._failed(tree, "timeouts", str(error))
        except RewardFailed as error:
            return self._failed(tree, "errors", str(error))
        except Exception as error:  # the user's code: any failure costs this tree only
            return self._failed(tree, "errors", f"{type(error).__name__}: {error}")
        problem = _problem(result)
        return result if problem is None else self._failed(tree, "errors", problem)

    def _failed(self, tree: CloneTree, kind: str, why: str) -> RewardResult:
        self.failures.append(f"tree {tree.task_id}#{tree.sample_index}: {why}")
        return RewardResult(score=0.0, correct=False, info={kind: 1.0})

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if callable(close):
            close()


def _problem(result: Any) -> str | None:
    """Why a reward's return value cannot be trained on, or None."""
    if not isinstance(result, RewardResult):
        return f"returned {repr(result)[:200]}, not a RewardResult"
    if not _finite(result.score):
        return f"returned the score {result.score!r}, not a finite number"
    bad = {k: v for k, v in (result.node_rewards or {}).items() if not _finite(v)}
    if bad:
        return f"returned node rewards that are not finite numbers: {dict(list(bad.items())[:3])}"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)
