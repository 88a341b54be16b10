"""Demonstration traces for warm starts: a scripted teacher plays every agent of a tree.

A teacher is a function from a node's prompt text to its next turn. The rollout engine runs
it through `ScriptedBackend`, so demonstrations are real `CloneTree`s, built by the same
protocol, budgets and return rendering as the model's own rollouts: SFT on them teaches
exactly the token format RL will later sample.

`KeyedSumTeacher` writes correct keyed_sum solutions. Its chain of thought is built so that
every step is local and easy for a model of a few hundred thousand parameters (each choice
below was measured against the alternatives on the CPU experiment's model):

- a list is summed on one line that starts with its key, one single-digit addition per step
  (``L2 +3=3 +2=5 +1=6``), so the number to add next sits at a fixed place in a short list;
- a node that holds several lists sums each on its own line, then adds the list totals on a
  last line (``+6=6 +5=11``): the same skill again, on numbers the node just wrote;
- a node that delegates splits its keys into a few contiguous groups (two by default:
  ``<spawn>sum @L1 @L2<sep>sum @L3 @L4</spawn>``) and adds the returned answers the same way.
  With two clones per call the answers to add sit right after ``<return>`` and right before
  ``</return>``, whatever the number of keys, which a tiny model reads far more reliably
  than the k-th of k answers. Recursive halving also makes a tree for 6 keys out of the same
  node jobs as a tree for 4 keys, which is what lets delegation reach out-of-distribution
  sizes.

Roots that see keys only must delegate; roots that see the lists inline solve them
monolithically (or, with ``delegate_inline``, delegate by key). A clone given two or more
keys delegates again with probability ``redelegate`` and otherwise sums its lists itself,
so the warm start holds both behaviours at every level and RL has choices to make.

`demonstrations` builds the warm-start dataset a `WarmStartConfig` describes: a task source
(say, a ``mix`` of keys-only tasks, demonstrated by delegation, and inline tasks, demonstrated
monolithically, over ranges of key counts) solved by a named teacher under a budget.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from selfcest.budget import Budget
from selfcest.protocol import Protocol, TokenProtocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.tasks import load_tasks
from selfcest.tasks.base import Task
from selfcest.train.gym_teacher import ChainSumTeacher
from selfcest.tree import CloneTree

Teacher = Callable[[str], str]

_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_LIST = re.compile(r"^\[(\w+)\] ([\d ]+)$", re.MULTILINE)
_KEYS_ONLY = re.compile(r"^Add all numbers in ((?:\w+ ?)+)\.")
_RETURN = re.compile(r"<return>(.*?)</return>", re.DOTALL)
_END = "<|im_end|>"


def running_sum(values: Sequence[int]) -> tuple[str, int]:
    """``("+3=3 +5=8 +2=10", 10)``: one addition per step, and the total."""
    total, steps = 0, []
    for value in values:
        total += value
        steps.append(f"+{value}={total}")
    return " ".join(steps), total


def solve_lists(lists: Sequence[tuple[str, Sequence[int]]], answer_width: int = 0) -> str:
    """A node's monolithic solution of its ``(key, numbers)`` lists, ending its turn::

        L1 +0=0 +1=1 +3=4
        L2 +3=3 +2=5 +1=6
        +4=4 +6=10
        Answer: 10

    The answer is zero-padded to ``answer_width`` digits (see `KeyedSumTeacher`).
    """
    lines, totals = [], []
    for key, values in lists:
        steps, total = running_sum(values)
        lines.append(f"{key} {steps}")
        totals.append(total)
    if len(totals) > 1:
        steps, _ = running_sum(totals)
        lines.append(steps)
    return "\n".join(lines) + f"\nAnswer: {sum(totals):0{answer_width}d}{_END}"


def add_answers(answers: Sequence[str], width: int = 0, answer_width: int = 0) -> str:
    """The turn after a spawn call: add the clones' answers as written, with running totals
    zero-padded to ``width`` digits (``+07=07 +11=18``), then give the total, zero-padded to
    ``answer_width`` digits."""
    total, steps = 0, []
    for answer in answers:
        total += int(answer)
        steps.append(f"+{answer}={total:0{width}d}")
    return " ".join(steps) + f"\nAnswer: {total:0{answer_width}d}{_END}"


def split_keys(keys: Sequence[str], groups: int) -> list[list[str]]:
    """``keys`` cut into ``groups`` contiguous groups whose sizes differ by at most one
    (larger groups first): 5 keys in 2 groups are 3 + 2."""
    groups = max(1, min(groups, len(keys)))
    size, extra = divmod(len(keys), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(list(keys[start:end]))
        start = end
    return out


def spawn_call(groups: Sequence[Sequence[str]]) -> str:
    """``<spawn>sum @L1 @L2<sep>sum @L3</spawn>``: one clone per group of keys."""
    objectives = ["sum " + " ".join("@" + key for key in group) for group in groups]
    return TokenProtocol.SPAWN + TokenProtocol.SEP.join(objectives) + TokenProtocol.END


@dataclass
class KeyedSumTeacher:
    """Correct keyed_sum demonstrations with varied delegation (see the module docstring).

    Expects the token protocol without system prompts, as `ClonePolicy.build_tiny` makes it.
    """

    # Clones one spawn call starts, drawn per call; the node's keys are split evenly among
    # them. (2,) halves the keys at every level; (4,) gives one key per clone at 4 keys.
    branching: tuple[int, ...] = (2,)
    # Probability that a clone holding two or more keys delegates them again rather than
    # summing its lists itself.
    redelegate: float = 0.7
    # Probability that a root which sees its lists inline delegates them by key rather than
    # solving them itself (a root that sees keys only always delegates).
    delegate_inline: float = 0.0
    # Clones write their answer zero-padded to this many digits, and every node pads the
    # running totals of the turn in which it adds its clones' answers the same way (0: no
    # padding; a root's final answer is never padded). Every answer a parent reads then has
    # the same number of tokens and that turn has one fixed layout (``+07=07 +11=18``): a
    # tiny model copies and adds digits at fixed places far more reliably than one- or
    # two-digit numbers at places that shift.
    answer_width: int = 2
    # Seed of the teacher's own draws (branching, redelegate, delegate_inline).
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.answer_width < 0:
            raise ValueError(f"answer_width must be >= 0, got {self.answer_width}")
        if not self.branching or min(self.branching) < 2:
            raise ValueError(f"branching must list clone counts >= 2, got {self.branching}")
        for name in ("redelegate", "delegate_inline"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability, got {getattr(self, name)}")
        self._rng = random.Random(self.seed)

    def __call__(self, prompt: str) -> str:
        user = _USER.search(prompt).group(1)
        is_root = not user.startswith("sum")
        assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
        returned = _RETURN.findall(assistant)
        width = 0 if is_root else self.answer_width
        if returned:  # resumed after the clones answered: add their answers
            return add_answers(returned[-1].split(TokenProtocol.SEP), self.answer_width, width)
        if " mod " in user:
            raise ValueError("KeyedSumTeacher demonstrates plain sums; set the task's modulus to 0")
        keys_only = _KEYS_ONLY.match(user)
        if keys_only:  # a root that sees keys only
            return self._delegate(keys_only.group(1).split())
        lists = [(key, [int(v) for v in text.split()]) for key, text in _LIST.findall(user)]
        if not lists:
            raise ValueError(f"not a keyed_sum prompt: {user!r}")
        chance = self.delegate_inline if is_root else self.redelegate
        if len(lists) >= 2 and self._rng.random() < chance:
            return self._delegate([key for key, _ in lists])
        return solve_lists(lists, width)

    def _delegate(self, keys: list[str]) -> str:
        return spawn_call(split_keys(keys, self._rng.choice(self.branching)))


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


TEACHERS: dict[str, type] = {"keyed_sum": KeyedSumTeacher, "chain_sum": ChainSumTeacher}


def demonstrations(
    tasks: Mapping[str, Any],
    teacher: str,
    teacher_params: Mapping[str, Any],
    protocol: Protocol,
    budget: Budget,
    exclude: Iterable[Task] = (),
) -> list[CloneTree]:
    """The warm-start dataset a `WarmStartConfig` describes: the tasks of the source
    ``tasks`` (``{"name": ..., "params": {...}}``, see `selfcest.tasks.load_tasks`) solved by
    the named teacher under ``budget``.

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
    loaded = [task for task in load_tasks(tasks["name"], **dict(tasks.get("params") or {}))
              if task_identity(task) not in held_out]
    if not loaded:
        raise ValueError(f"the warm-start task source {dict(tasks)} gave no tasks (after excluding held-out ones)")
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
