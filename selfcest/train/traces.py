"""Demonstrations for warm starts: a scripted teacher plays every agent of a tree.

A teacher is a function from a node's prompt text to its next turn; each task that has one
keeps it beside itself (`selfcest.tasks.TEACHERS`: ``keyed_sum``, ``chain_sum``). The
rollout engine runs it through `ScriptedBackend`, so demonstrations are real `CloneTree`s,
built by the same protocol, budgets and return rendering as the model's own rollouts: SFT on
them teaches exactly the token format RL will later sample.

`demonstrations` builds the warm-start dataset a `WarmStartConfig` describes: the tasks of a
source solved by a named teacher under a budget, held-out tasks left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from selfcest.budget import Budget
from selfcest.protocol import Protocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tasks import TEACHERS, load_tasks
from selfcest.train.config import TaskSourceConfig
from selfcest.tree import CloneTree

Teacher = Callable[[str], str]


def teacher_trees(
    tasks: Sequence[Task],
    teacher: Teacher,
    protocol: Protocol,
    budget: Budget,
    correct_only: bool = True,
) -> list[CloneTree]:
    """Run ``teacher`` as every agent of one tree per task; with ``correct_only``, keep the
    trees whose root answer equals their task's answer (a demonstration cut by a budget is
    not a demonstration; a teacher that raises fails its node, and so its tree)."""
    backend = ScriptedBackend(protocol.tokenizer, teacher, logprob=0.0)
    engine = RolloutEngine(backend, protocol, budget, SamplingParams(temperature=0))
    trees = engine.rollout(tasks, samples_per_task=1)
    if not correct_only:
        return trees
    # Match by position: task ids need not be unique across the splits one mixes.
    return [tree for tree in trees if tree.answer == tasks[tree.task_index].answer]


def demonstrations(
    tasks: TaskSourceConfig,
    teacher: str,
    teacher_params: Mapping[str, Any],
    protocol: Protocol,
    budget: Budget,
    exclude: Iterable[Task] = (),
) -> list[CloneTree]:
    """The warm-start dataset a `WarmStartConfig` describes: the tasks of the source
    ``tasks`` (see `selfcest.tasks.load_tasks`) solved by the named teacher under ``budget``.

    Tasks that share their identity with one of ``exclude`` (the experiment's held-out
    splits) are left out, so held-out tasks stay held out whichever prompt style shows them.
    Demonstrations the budget cuts short (an inline solution longer than
    ``budget.node_context``, a tree deeper than ``budget.max_depth``) are dropped, so the
    warm start only shows what the budget allows; if that drops more than half of them the
    budget does not fit the teacher, and this raises.
    """
    if teacher not in TEACHERS:
        raise ValueError(f"unknown teacher {teacher!r}; known: {', '.join(TEACHERS)}")
    held_out = {task_identity(task) for task in exclude}
    loaded = [task for task in load_tasks(tasks.name, **tasks.params)
              if task_identity(task) not in held_out]
    if not loaded:
        raise ValueError(f"the warm-start task source {tasks} gave no tasks (after excluding "
                         "held-out ones)")
    trees = teacher_trees(loaded, TEACHERS[teacher](**dict(teacher_params)), protocol, budget)
    if 2 * len(trees) < len(loaded):
        raise ValueError(
            f"only {len(trees)} of {len(loaded)} demonstrations fit warm_start.budget "
            f"({budget}); raise its max_depth, node_context or generation limits"
        )
    return trees


def task_identity(task: Task) -> tuple:
    """What makes two tasks the same problem: their context (keyed_sum's lists, whether the
    prompt prints them or not), or their prompt when they have none."""
    return tuple(sorted(task.context.items())) if task.context else (task.prompt,)
