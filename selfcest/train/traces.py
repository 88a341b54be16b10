"""Demonstration traces for warm starts: a scripted teacher plays every agent of a tree.

A teacher is a function from a node's prompt text to its next turn. The rollout engine runs
it through `ScriptedBackend`, so demonstrations are real `CloneTree`s built by the same
protocol, budgets and return rendering as the model's own rollouts: SFT on them teaches
exactly the token format RL later samples.

`KeyedSumTeacher` writes correct keyed_sum solutions in two styles:

- delegating, for prompts that show keys only: the root hands groups of keys to clones
  (``<spawn>sum @L1<sep>sum @L2 @L3</spawn>``), each clone adds its lists with a running
  sum (``+3=3 +5=8 +2=0 +7=7 Answer: 7`` under ``mod 10``), and the root adds the returned
  results the same way. The group size is drawn per spawn call, so RL starts with several
  ways to split a task to choose from;
- monolithic, for prompts that print the lists inline: the same computation in one
  context — a running sum per list (``L1 +3=3 …``), then one over the subtotals.

Every step of every running sum is one small addition, so a tiny model can learn it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from selfcest.budget import Budget
from selfcest.protocol import Protocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.tasks import load_tasks
from selfcest.tasks.base import Task
from selfcest.tree import CloneTree

Teacher = Callable[[str], str]

_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_LIST = re.compile(r"^\[(\w+)\] ([\d ]+)$", re.MULTILINE)
_KEYS_ONLY = re.compile(r"Add all numbers in ((?:\w+ ?)+?)(?: mod \d+)?\.")
_RETURN = re.compile(r"<return>(.*?)</return>", re.DOTALL)
END = "<|im_end|>"


@dataclass
class KeyedSumTeacher:
    """Correct keyed_sum demonstrations with varied delegation (see the module docstring)."""

    # The task's modulus (0: plain sums); every partial result is reduced by it.
    modulus: int = 10
    # Keys handed to one clone: one size is drawn per spawn call.
    group_sizes: tuple[int, ...] = (1,)
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.group_sizes or min(self.group_sizes) < 1:
            raise ValueError(f"group_sizes must be positive, got {self.group_sizes}")
        self._rng = random.Random(self.seed)

    def __call__(self, prompt: str) -> str:
        user = _USER.search(prompt).group(1)
        assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
        returned = _RETURN.findall(assistant)
        if returned:  # resumed after the clones answered: add their results
            return self.running_sum([int(v) for v in returned[-1].split("<sep>")])
        lists = _LIST.findall(user)
        keys_only = _KEYS_ONLY.match(user)
        if keys_only and not lists:  # the root of a delegating task sees keys only
            return self.delegate(keys_only.group(1).split())
        if user.startswith("Add all numbers"):  # the root of an inline task: monolithic
            return self.subtotals(lists)
        return self.running_sum([int(v) for _, text in lists for v in text.split()])

    def steps(self, values: Sequence[int]) -> tuple[str, int]:
        total, steps = 0, []
        for value in values:
            total = self._reduce(total + value)
            steps.append(f"+{value}={total}")
        return " ".join(steps), total

    def running_sum(self, values: Sequence[int]) -> str:
        body, total = self.steps(values)
        return f"{body}\nAnswer: {total}{END}"

    def subtotals(self, lists: Sequence[tuple[str, str]]) -> str:
        lines, subtotals = [], []
        for key, text in lists:
            body, total = self.steps([int(v) for v in text.split()])
            lines.append(f"{key} {body}")
            subtotals.append(total)
        body, total = self.steps(subtotals)
        return "\n".join(lines + [body]) + f"\nAnswer: {total}{END}"

    def delegate(self, keys: Sequence[str]) -> str:
        size = self._rng.choice([s for s in self.group_sizes if s <= len(keys)] or [1])
        groups = [keys[i : i + size] for i in range(0, len(keys), size)]
        objectives = ["sum " + " ".join("@" + key for key in group) for group in groups]
        return "<spawn>" + "<sep>".join(objectives) + "</spawn>"

    def _reduce(self, value: int) -> int:
        return value % self.modulus if self.modulus else value


TEACHERS: dict[str, type] = {"keyed_sum": KeyedSumTeacher}


def teacher_trees(
    tasks: Sequence[Task],
    teacher: Teacher,
    protocol: Protocol,
    budget: Budget,
    correct_only: bool = True,
) -> list[CloneTree]:
    """Run ``teacher`` as every agent of one tree per task; keep the trees whose root answer
    equals the task's answer (a demonstration cut by a budget is not a demonstration)."""
    backend = ScriptedBackend(protocol.tokenizer, teacher, logprob=0.0)
    engine = RolloutEngine(backend, protocol, budget, SamplingParams(temperature=0))
    trees = engine.rollout(tasks, samples_per_task=1)
    if not correct_only:
        return trees
    answers = {task.id: task.answer for task in tasks}
    return [t for t in trees if t.answer == answers[t.task_id]]


def delegator_copies(trees: Sequence[CloneTree], copies: int) -> list[CloneTree]:
    """Trees holding only one delegating node each, ``copies`` per such node.

    A delegating node writes a few tokens of spawn call and of combining, against many
    more tokens of its clones' work; repeating its sequence in SFT balances what the
    model practises (the other nodes are not duplicated). Copies share the node's token
    lists: SFT only reads them.
    """
    extra = []
    for tree in trees:
        for node in tree.nodes.values():
            if not node.spawns:
                continue
            alone = replace(node, id=CloneTree.ROOT_ID, parent_id=None)
            for _ in range(copies):
                copy = CloneTree(task_id=tree.task_id, task_index=tree.task_index,
                                 sample_index=tree.sample_index)
                copy.add(alone)
                extra.append(copy)
    return extra


def demonstrations(
    tasks: dict[str, Any],
    teacher: str,
    teacher_params: dict[str, Any],
    protocol: Protocol,
    budget: Budget,
    delegator_repeat: int = 0,
) -> list[CloneTree]:
    """The warm-start dataset a config describes: ``tasks`` (a `load_tasks` source:
    ``{"name": ..., "params": {...}}``) solved by the named teacher under ``budget``, plus
    ``delegator_repeat`` extra copies of every delegating node."""
    if teacher not in TEACHERS:
        raise ValueError(f"unknown teacher {teacher!r}; known: {', '.join(TEACHERS)}")
    loaded = load_tasks(tasks["name"], **dict(tasks.get("params") or {}))
    trees = teacher_trees(loaded, TEACHERS[teacher](**teacher_params), protocol, budget)
    return trees + delegator_copies(trees, delegator_repeat)
