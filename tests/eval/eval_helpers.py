"""Helpers for the evaluation tests: an exact-match reward, and a scripted policy whose
answers are known, so method logic can be checked against exact accuracies.

(A plain module, not a conftest: the suite's top-level conftest is imported as ``conftest``
too, and the two would shadow each other.)"""

from __future__ import annotations

import re
from collections.abc import Callable

from selfcest.budget import Budget
from selfcest.rewards.base import RewardResult
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tree import CloneTree


def exact_match(tree: CloneTree, task: Task) -> RewardResult:
    """1 for a root answer equal to the reference (surrounding spaces ignored), else 0."""
    correct = tree.answer.strip() == task.answer.strip()
    return RewardResult(score=float(correct), correct=correct, info={"exact": float(correct)})


class ScriptedPolicy:
    """Builds engines over a fresh `ScriptedBackend` each time, as `ClonePolicy.engine` does
    over a fresh HF backend; keeps every backend and budget so tests can inspect the calls."""

    def __init__(self, protocol, make_respond: Callable[[], Callable[[str], str]]):
        self.protocol = protocol
        self.make_respond = make_respond
        self.backends: list[ScriptedBackend] = []
        self.budgets: list[Budget] = []

    def engine(self, budget: Budget, sampling: SamplingParams | None, seed: int) -> RolloutEngine:
        backend = ScriptedBackend(self.protocol.tokenizer, self.make_respond())
        self.backends.append(backend)
        self.budgets.append(budget)
        return RolloutEngine(backend, self.protocol, budget, sampling, seed)


LISTS = re.compile(r"\[(L\d+)\] ([\d ]+)")


def delegation_script() -> Callable[[str], str]:
    """A perfect delegator for `keyed_tasks`.

    The root (which sees only keys) spawns one clone per key and answers the sum of their
    returns; a clone sums the list it was handed; a root that reads the lists inline (see
    `inline_view`) sums them itself. When the spawn is refused, the root answers "unknown".
    """

    def respond(text: str) -> str:
        if "<return>" in text:
            returned = text[text.rindex("<return>") + len("<return>"): text.rindex("</return>")]
            if "error" in returned:
                return "Answer: unknown"
            return f"Answer: {sum(int(part) for part in returned.split('<sep>'))}"
        lists = LISTS.findall(text)
        if lists:
            return f"Answer: {sum(int(n) for _, numbers in lists for n in numbers.split())}"
        keys = re.findall(r"\b(L\d+)\b", text)
        return "<spawn>" + "<sep>".join(f"sum @{key}" for key in dict.fromkeys(keys)) + "</spawn>"

    return respond


def keyed_tasks(count: int, keys: int = 2, prefix: str = "t") -> list[Task]:
    """Tasks whose root sees keys only; each key holds a short list of small numbers."""
    tasks = []
    for i in range(count):
        context = {f"L{k + 1}": f"{i + k} {k + 1}" for k in range(keys)}
        total = sum(int(n) for numbers in context.values() for n in numbers.split())
        prompt = "Add all numbers in " + " ".join(context) + "."
        tasks.append(Task(f"{prefix}{i}", prompt, str(total), context))
    return tasks


def inline_view(task: Task) -> Task:
    """The same task with every list written into the root's prompt."""
    inline = "\n".join(f"[{key}] {text}" for key, text in task.context.items())
    return Task(task.id, f"{task.prompt}\n{inline}", task.answer, {}, task.source,
                dict(task.metadata))
