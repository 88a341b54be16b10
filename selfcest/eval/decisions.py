"""Delegation decisions on held-out tasks: what a policy chooses, and what each style earns.

A policy is run on the same tasks in three modes (`Mode`):

- ``free``: as trained; the root decides whether to spawn and how many clones;
- ``direct``: the spawn-open token is never sampled (`SamplingParams.banned_token_ids`) and
  spawning is disabled (``max_depth = 0``): the root solves alone;
- ``delegate``: every root's turn starts with the spawn-open token, prefilled by the engine
  (masked out of training, not counted as generated): the root must delegate and decides only
  what and to how many clones.

Every tree becomes one `Decision` row. `per_size` turns the rows into one `SizeRow` per task
size (a task's size is its number of context keys): the delegation rate and branching of the
free policy, each mode's reward, and which forced style is better, each with a 95% bootstrap
interval over tasks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from selfcest.budget import Budget
from selfcest.configure import Choice
from selfcest.eval.stats import Estimate, bootstrap_mean
from selfcest.policy import ClonePolicy
from selfcest.rewards.base import RewardFn, score_trees
from selfcest.rollout.backends.base import Backend, SamplingParams
from selfcest.task import Task
from selfcest.tree import CloneTree


class Mode(Choice):
    FREE = "free"
    DIRECT = "direct"
    DELEGATE = "delegate"


@dataclass(frozen=True)
class Decision:
    """One tree: the task it solved, the mode, what the root chose and what it earned."""

    task_id: str
    size: int  # the task's number of context keys
    mode: str  # a `Mode` value
    reward: float
    correct: bool
    delegated: bool  # the root's first turn opened a spawn call (``delegate`` mode: always)
    clones: int  # clones the root's first spawn call started (0: none)
    generated_tokens: int
    critical_path_tokens: int


def decision_of(tree: CloneTree, task: Task, mode: Mode, spawn_open_id: int) -> Decision:
    """The row of one scored tree. A root counts as delegating when its first turn opens a
    spawn call, closed or not (a call cut off by the budget was still the choice to
    delegate); its branching is the clones its first call started."""
    root, costs = tree.root, tree.costs()
    return Decision(
        task_id=task.id, size=len(task.context), mode=str(mode), reward=float(tree.reward),
        correct=bool(tree.correct), delegated=spawn_open_id in root.first_turn_ids(),
        clones=len(root.spawns[0].child_ids) if root.spawns else 0,
        generated_tokens=costs.generated_tokens, critical_path_tokens=costs.critical_path_tokens,
    )


def sample_trees(policy: ClonePolicy, tasks: Sequence[Task], mode: Mode, budget: Budget,
                 sampling: SamplingParams, samples: int = 1, seed: int = 0,
                 backend: Backend | None = None) -> list[CloneTree]:
    """``samples`` unscored trees per task in ``mode`` (``backend``: the policy's own unless
    given). Trees do not depend on the reward, so one sample serves every cost setting."""
    prefill: list[int] = []
    if mode == Mode.DIRECT:  # no call can be opened, and none would be served
        budget = replace(budget, max_depth=0)
        sampling = replace(sampling, banned_token_ids=(*sampling.banned_token_ids,
                                                       policy.protocol.spawn_open_id))
    elif mode == Mode.DELEGATE:
        prefill = [policy.protocol.spawn_open_id]
    engine = policy.engine(budget, sampling, seed=seed, backend=backend, root_prefill=prefill)
    return engine.rollout(tasks, samples_per_task=samples)


def score_decisions(trees: Sequence[CloneTree], tasks: Sequence[Task], mode: Mode,
                    reward_fn: RewardFn,
                    spawn_open_id: int) -> list[Decision]:
    """The `Decision` rows of ``trees`` (of ``tasks``, in ``mode``), scored by ``reward_fn``."""
    score_trees(trees, tasks, reward_fn)
    return [decision_of(tree, tasks[tree.task_index], mode, spawn_open_id) for tree in trees]


def sample_decisions(policy: ClonePolicy, tasks: Sequence[Task], mode: Mode, budget: Budget,
                     sampling: SamplingParams, reward_fn: RewardFn, samples: int = 1,
                     seed: int = 0, backend: Backend | None = None) -> list[Decision]:
    """``samples`` trees per task in ``mode``, scored by ``reward_fn``."""
    trees = sample_trees(policy, tasks, mode, budget, sampling, samples, seed, backend)
    return score_decisions(trees, tasks, mode, reward_fn, policy.protocol.spawn_open_id)


@dataclass(frozen=True)
class SizeRow:
    """One task size: the free policy's choices and every mode's reward."""

    size: int
    tasks: int
    delegation_rate: Estimate | None  # P(the root spawns | size), free mode (None: not run)
    branching: Estimate | None  # mean clones of the first call, over delegating free trees
    reward: dict[str, Estimate]  # per mode present
    accuracy: dict[str, Estimate]  # per mode present
    # Forced delegate minus forced direct, paired over tasks; None without both modes.
    delegate_gain: Estimate | None
    # "delegate" or "direct" where ``delegate_gain``'s interval excludes 0, else "tie".
    better: str


def per_task(decisions: Iterable[Decision], field: str, mode: str) -> dict[str, float]:
    """Mean of ``field`` over each task's trees in ``mode`` (bools count as 0/1)."""
    values: dict[str, list[float]] = defaultdict(list)
    for d in decisions:
        if d.mode == mode:
            values[d.task_id].append(float(getattr(d, field)))
    return {task: statistics.fmean(v) for task, v in values.items()}


def paired_gap(a: dict[str, float], b: dict[str, float], resamples: int, seed: int = 0) -> Estimate:
    """Mean of ``a - b`` over the tasks both hold, with its bootstrap interval."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("no task in common to pair")
    return bootstrap_mean([a[t] - b[t] for t in common], resamples, seed=seed)


def per_size(decisions: Sequence[Decision], resamples: int = 1000, seed: int = 0) -> list[SizeRow]:
    """One `SizeRow` per size present, smallest first.

    A tree's samples of one task are averaged first, so intervals count tasks, not trees.
    """
    rows = []
    for size in sorted({d.size for d in decisions}):
        mine = [d for d in decisions if d.size == size]
        modes = [m.value for m in Mode if any(d.mode == m.value for d in mine)]

        def estimate(field: str, mode: str) -> Estimate:
            return bootstrap_mean(list(per_task(mine, field, mode).values()), resamples, seed=seed)

        free = [d for d in mine if d.mode == Mode.FREE.value]
        branching = [float(d.clones) for d in free if d.delegated]
        gain = None
        if Mode.DIRECT.value in modes and Mode.DELEGATE.value in modes:
            gain = paired_gap(per_task(mine, "reward", Mode.DELEGATE.value),
                              per_task(mine, "reward", Mode.DIRECT.value), resamples, seed)
        rows.append(SizeRow(
            size=size, tasks=len({d.task_id for d in mine}),
            delegation_rate=estimate("delegated", Mode.FREE.value) if free else None,
            branching=bootstrap_mean(branching, resamples, seed=seed) if branching else None,
            reward={m: estimate("reward", m) for m in modes},
            accuracy={m: estimate("correct", m) for m in modes},
            delegate_gain=gain, better=_better(gain),
        ))
    return rows


def _better(gain: Estimate | None) -> str:
    if gain is None or gain.low <= 0 <= gain.high:
        return "tie"
    return "delegate" if gain.low > 0 else "direct"
