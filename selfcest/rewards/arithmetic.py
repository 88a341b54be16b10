"""Integer answers (arithmetic, keyed_sum): exact match, optional partial credit.

The answer is the root's final-turn ``Answer:`` line (`selfcest.protocol.extract_answer`:
else its last non-empty line), and the integer read from it is the **last** number written
there, as the reference does (``"Answer: 3 + 4 = 7"`` reads 7): commas are thousands
separators, a ``-`` (or ``−``) is a sign unless it follows a digit or letter (``12-3`` reads
3), and a number with a non-zero fractional part is no integer (``"7.5"`` reads nothing).

Score: 1.0 when that integer equals the reference; otherwise 0, or with ``partial_credit``
the reference's closeness bonus

    0.2 / log2(2 + |A - B| / sqrt(2 + |max(A, B)|))

which lies in (0, 0.2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from selfcest.protocol import extract_answer
from selfcest.rewards.base import TaskScore
from selfcest.rewards.compose import ComposedReward
from selfcest.rewards.cost import CostConfig
from selfcest.task import Task

_NUMBER = re.compile(r"(?<![\w.])([-−]?)(\d[\d,]*)(\.\d+)?")
# Above this many bits of |A - B| / sqrt(...), log2(2 + x) equals log2(x) to float precision.
_LOG_SPACE_BITS = 60


def last_integer(text: str) -> int | None:
    """The last number in ``text`` as an integer (see the module docstring), or None."""
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    sign, digits, fraction = matches[-1].groups()
    if fraction and fraction.strip(".0"):
        return None
    value = int(digits.replace(",", ""))
    return -value if sign else value


def closeness_credit(a: int, b: int, scale: float = 0.2) -> float:
    """``scale / log2(2 + |a - b| / sqrt(2 + |max(a, b)|))`` for a != b (1.0 when equal).

    The reference writes ``sqrt(|2 + max(A, B)|)``, which divides by zero when max(A, B) = -2
    (its exception path then gave 0); ``2 + |max|`` is never below 2 and equals the reference
    whenever max(A, B) >= 0. Computed in log space, so answers with thousands of digits cost no
    float overflow.
    """
    if a == b:
        return 1.0
    log_x = math.log2(abs(a - b)) - 0.5 * math.log2(2 + abs(max(a, b)))
    if log_x > _LOG_SPACE_BITS:
        return scale / log_x
    return scale / math.log2(2 + 2.0**log_x)


@dataclass(frozen=True)
class IntegerScorer:
    """Task scorer for integer answers; ``info["answer_missing"]`` flags no readable number."""

    partial_credit: bool = False  # give the closeness bonus to wrong integers

    def __call__(self, text: str, task: Task) -> TaskScore:
        gold = last_integer(task.answer)
        if gold is None:
            raise ValueError(f"task {task.id}: reference answer {task.answer!r} is no integer")
        answer = last_integer(extract_answer(text))
        if answer is None:
            return TaskScore(0.0, False, {"answer_missing": 1.0})
        if answer == gold:
            return TaskScore(1.0, True, {"answer_missing": 0.0})
        score = closeness_credit(answer, gold) if self.partial_credit else 0.0
        return TaskScore(score, False, {"answer_missing": 0.0})


def arithmetic_reward(
    *,
    partial_credit: bool = False,
    cost: CostConfig | dict | None = CostConfig(),
    **options: Any,
) -> ComposedReward:
    """Integer exact match (optionally with partial credit) minus ``cost`` (default: the
    reference arithmetic shaping); ``options`` go to `ComposedReward`. Also fits keyed_sum."""
    return ComposedReward(IntegerScorer(partial_credit), cost, **options)
