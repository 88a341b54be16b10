"""Short-answer QA (2WikiMultihopQA, MuSiQue): exact match and token F1 with aliases.

The answer is the root's final-turn ``Answer:`` line (`selfcest.protocol.extract_answer`).
Both sides are normalised as in SQuAD's evaluation: lowercase, punctuation removed, the
articles a/an/the removed, whitespace collapsed (``"The Eiffel Tower."`` → ``"eiffel
tower"``). References are ``task.answer`` plus ``task.metadata["aliases"]`` (a list, or one
string); a prediction is scored against each and the best counts:

- exact match: 1 if the normalised strings are equal;
- token F1: ``2 P R / (P + R)`` over the bags of normalised tokens, with precision P = common
  tokens / prediction tokens and recall R = common tokens / reference tokens.

``correct`` is always exact match; the score is EM or F1 (``metric``), and ``info`` has both
(``qa/em``, ``qa/f1``) and ``answer_missing`` (1.0 when no answer could be read).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from selfcest.protocol import extract_answer
from selfcest.rewards.base import TaskScore
from selfcest.rewards.compose import ComposedReward
from selfcest.rewards.cost import CostConfig
from selfcest.task import Task

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    predicted = normalize_answer(prediction).split()
    expected = normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def references(task: Task) -> list[str]:
    """The answer and its aliases (``metadata["aliases"]``: a list of strings, or a string)."""
    aliases = task.metadata.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"task {task.id}: metadata['aliases'] must be a list of strings")
    return [task.answer, *aliases]


@dataclass(frozen=True)
class QAScorer:
    """Task scorer for short answers: EM or token F1, best over the answer and its aliases."""

    metric: str = "em"  # the score: "em" (exact match) or "f1" (token F1)

    def __post_init__(self) -> None:
        if self.metric not in ("em", "f1"):
            raise ValueError(f"metric must be 'em' or 'f1', got {self.metric!r}")

    def __call__(self, text: str, task: Task) -> TaskScore:
        answer = extract_answer(text)
        golds = references(task)
        em = max(exact_match(answer, gold) for gold in golds) if answer else 0.0
        f1 = max(token_f1(answer, gold) for gold in golds) if answer else 0.0
        score = em if self.metric == "em" else f1
        info = {"qa/em": em, "qa/f1": f1, "answer_missing": float(not answer)}
        return TaskScore(score, em == 1.0, info)


def qa_reward(
    *, metric: str = "em", cost: CostConfig | dict | None = CostConfig(), **options: Any
) -> ComposedReward:
    """QA scorer (``metric`` "em" or "f1") minus ``cost`` (default: the reference long-context
    shaping); ``options`` go to `ComposedReward`."""
    return ComposedReward(QAScorer(metric), cost, **options)
