"""The reward contract: one global score per clone tree, plus optional per-node rewards.

A reward function is any ``RewardFn``: ``(tree, task) -> RewardResult``. Most are built by
`selfcest.rewards.compose.make_reward` from a ``TaskScorer`` (which judges the root's final
turn text against the task) and a cost shaping config. `load_reward` finds one by a dotted
or file path, failing loudly; `score_trees` applies one to a batch of trees.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfcest.task import Task
from selfcest.tree import CloneTree


@dataclass
class RewardResult:
    """What a reward function says about one tree."""

    score: float  # the global, possibly cost-shaped reward the trainer optimises
    correct: bool  # task correctness of the root's answer, reported apart from the score
    node_rewards: dict[str, float] | None = None  # optional reward per node id
    malformed: list[str] = field(default_factory=list)  # ids of clones breaking the format rule
    info: dict[str, float] = field(default_factory=dict)  # components (task score, penalties)


RewardFn = Callable[[CloneTree, Task], RewardResult]


@dataclass(frozen=True)
class TaskScore:
    """How well an answer text solves a task, before any cost shaping."""

    score: float  # task score, usually in [0, 1] (1 for a correct answer)
    correct: bool  # the unshaped correctness reported as accuracy
    info: dict[str, float] = field(default_factory=dict)  # extra components, logged by name


# (root final-turn text, task) -> TaskScore
TaskScorer = Callable[[str, Task], TaskScore]

# The `TaskScore.info` flags that mean a reward could not judge an answer properly, with the
# short name the progress bar shows. Scorers set each to 1.0 on the trees it applies to.
DIAGNOSTICS = {
    "answer_missing": "missing",  # no answer could be read from the final turn
    "math/unparsed": "unparsed",  # math-verify could not parse the answer
    "math/gold_unparsed": "gold_unparsed",  # ... nor the reference
    "math/timeout": "timeout",  # a comparison ran past its time limit
    "math/error": "verify_error",  # the verifier failed
    "errors": "reward_errors",  # the reward function failed (`selfcest.rewards.guard`)
    "timeouts": "reward_timeouts",  # ... or ran past task.reward_timeout_s
}


def reward_components(tree: CloneTree) -> dict[str, float]:
    """The numeric entries of a scored tree's ``info`` (task score, the scorer's components and
    diagnostics, cost terms) as metrics named ``reward/<key>``."""
    return {
        f"reward/{key}": float(value)
        for key, value in tree.info.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def progress_summary(metrics: Mapping[str, float]) -> dict[str, str]:
    """What a progress bar shows of one step: reward, accuracy and every diagnostic rate."""
    summary = {"reward": f"{metrics['reward/mean']:.3f}", "acc": f"{metrics['accuracy']:.2f}"}
    for key, short in DIAGNOSTICS.items():
        if f"reward/{key}" in metrics:
            summary[short] = f"{metrics[f'reward/{key}']:.2f}"
    return summary

def final_turn_text(tree: CloneTree) -> str:
    """The root's final turn as plain text (`Node.final_text`: the sampled tokens after its
    last injected segment, decoded by the engine without any special token of the
    tokenizer; empty when the root ended inside a spawn call). Rewards read the answer from
    here only, never from earlier turns."""
    return tree.root.final_text


# ---------------------------------------------------------------------------------- loading


def load_reward(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """The reward function named by ``spec``; raises ValueError naming spec and reason.

    ``spec`` is ``"package.module:name"`` or ``"path/to/file.py:name"``. The named object is
    used as the reward if it can be called as ``obj(tree, task)``. A callable that takes
    keyword arguments only (such as `selfcest.rewards.arithmetic.arithmetic_reward`) is a
    factory: it is called with ``kwargs`` (none if omitted) and must return such a reward.
    Import errors, a missing name, a wrong signature or a failing factory all raise here,
    before any rollout, instead of falling back to a zero reward.
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name.isidentifier():
        raise ValueError(
            f"reward spec {spec!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    module = _import(spec, module_part)
    try:
        target = getattr(module, name)
    except AttributeError:
        raise ValueError(f"reward spec {spec!r}: {module_part} has no attribute {name!r}") from None
    if not inspect.isclass(target) and _accepts(target, 2):
        if kwargs:
            raise ValueError(f"reward spec {spec!r}: a (tree, task) reward takes no arguments; "
                             f"got reward_params {sorted(kwargs)} (a keyword-only factory can take "
                             "them)")
        return target
    if not _accepts(target, 0, dict(kwargs or {})):
        raise ValueError(
            f"reward spec {spec!r}: {name} neither takes (tree, task) nor is a keyword-only "
            f"factory accepting {sorted(kwargs or {})}"
        )
    try:
        reward = target(**dict(kwargs or {}))
    except Exception as error:
        raise ValueError(
            f"reward spec {spec!r}: the factory raised {type(error).__name__}: {error}"
        ) from error
    if not _accepts(reward, 2):
        raise ValueError(f"reward spec {spec!r}: the factory returned {reward!r}, not a reward")
    return reward


def _import(spec: str, module_part: str):
    is_file = module_part.endswith(".py") or "/" in module_part or "\\" in module_part
    if not is_file:
        try:
            return importlib.import_module(module_part)
        except Exception as error:
            raise ValueError(
                f"reward spec {spec!r}: importing {module_part} raised "
                f"{type(error).__name__}: {error}"
            ) from error
    path = Path(module_part).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward spec {spec!r}: no file {path}")
    # A unique module name per file, registered so dataclasses and pickling inside it work.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"selfcest_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ValueError(
            f"reward spec {spec!r}: executing {path} raised {type(error).__name__}: {error}"
        ) from error
    return module


def _accepts(target: Any, positional: int, keywords: dict[str, Any] | None = None) -> bool:
    """Whether ``target`` can be called with that many positional arguments (and keywords)."""
    if not callable(target):
        return False
    try:
        inspect.signature(target).bind(*([None] * positional), **(keywords or {}))
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------- scoring


def score_trees(
    trees: Iterable[CloneTree],
    tasks: Mapping[str, Task] | Iterable[Task],
    reward_fn: RewardFn,
) -> list[RewardResult]:
    """Score each tree against its task (found by ``tree.task_id``) and attach the result.

    Sets ``tree.reward``, ``tree.correct`` and ``tree.node_rewards``, and merges the result's
    ``info`` plus ``"malformed_nodes"`` (the malformed clone ids) into ``tree.info``. A tree
    whose task is missing, a reward function that raises (re-raised as a RuntimeError naming
    the tree) or that returns a non-finite score stops the batch: no tree silently gets 0.
    """
    by_id = tasks if isinstance(tasks, Mapping) else _index(tasks)
    results = []
    for tree in trees:
        where = f"tree {tree.task_id}#{tree.sample_index}"
        task = by_id.get(tree.task_id)
        if task is None:
            raise ValueError(f"{where}: no task with id {tree.task_id!r}")
        try:
            result = reward_fn(tree, task)
        except Exception as error:
            raise RuntimeError(f"the reward function failed on {where}: {error}") from error
        if not isinstance(result, RewardResult) or not math.isfinite(result.score):
            raise ValueError(f"{where}: the reward function returned {result!r}")
        tree.reward = float(result.score)
        tree.correct = bool(result.correct)
        tree.node_rewards = None if result.node_rewards is None else dict(result.node_rewards)
        tree.info.update(result.info)
        tree.info[CloneTree.MALFORMED_KEY] = list(result.malformed)
        results.append(result)
    return results


def _index(tasks: Iterable[Task]) -> dict[str, Task]:
    by_id: dict[str, Task] = {}
    for task in tasks:
        if task.id in by_id and by_id[task.id] != task:
            raise ValueError(f"two different tasks share the id {task.id!r}")
        by_id[task.id] = task
    return by_id
