"""The keyed_sum teacher: correct demonstrations of `selfcest.tasks.keyed_sum` tasks.

`KeyedSumTeacher` plays every agent of a clone tree in the token protocol (it maps a node's
prompt text, as `keyed_sum` renders it and the engine frames it, to the node's next turn;
`selfcest.train.traces.teacher_trees` runs it through the real engine). Roots that see keys
only must delegate; roots that see the lists inline solve them monolithically (or, with
``delegate_inline``, delegate by key). A clone given two or more keys delegates again with
probability ``redelegate``, otherwise it sums its lists itself, so the warm start holds both
behaviours at every level and RL has choices to make. Why the chain of thought looks the way
it does (one addition per step, halving the keys, zero-padded answers) was measured on the
CPU reproduction's model: ``docs/cpu_reproduction.md``, "The warm start".
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from selfcest.protocol import TokenProtocol

_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_LIST = re.compile(r"^\[(\w+)\] ([\d ]+)$", re.MULTILINE)
# Keys begin with a capital (L1, B), which tells them from the "mod" that may follow.
_KEYS_ONLY = re.compile(r"^Add all numbers in ((?:[A-Z]\w* ?)+)(?: mod \d+)?\.")
_MODULUS = re.compile(r" mod (\d+)\.")
_RETURN = re.compile(r"<return>(.*?)</return>", re.DOTALL)
_END = "<|im_end|>"
DIRECT_STYLES = ("per_list", "copy")


def running_sum(values: Sequence[int], start: int = 0, modulus: int = 0) -> tuple[str, int]:
    """``("+3=3 +5=8 +2=10", 10)``: one addition per step from ``start`` (each total taken
    modulo ``modulus`` when set), and the total."""
    total, steps = start, []
    for value in values:
        total = _reduce(total + value, modulus)
        steps.append(f"+{value}={total}")
    return " ".join(steps), total


def _reduce(value: int, modulus: int) -> int:
    return value % modulus if modulus else value


def solve_lists(lists: Sequence[tuple[str, Sequence[int]]], answer_width: int = 0,
                style: str = "per_list", modulus: int = 0) -> str:
    """A node's monolithic solution of its ``(key, numbers)`` lists, ending its turn.

    ``per_list`` sums each list, then the lists' totals; ``copy`` copies each list beside its
    key, then adds its numbers to one running total, so every step reads only what is next to
    it (a 2-layer model copies a span after a key far more reliably than it picks the i-th
    number of a list from the prompt or a total from an earlier line)::

        per_list                copy
        L1 +0=0 +1=1 +3=4       L1 0 1 3 +0=0 +1=1 +3=4
        L2 +3=3 +2=5 +1=6       L2 3 2 1 +3=7 +2=9 +1=10
        +4=4 +6=10              Answer: 10
        Answer: 10

    With a ``modulus`` (``copy`` only) every total is taken modulo it. The answer is
    zero-padded to ``answer_width`` digits (see `KeyedSumTeacher`).
    """
    if style == "copy":
        lines, total = [], 0
        for key, values in lists:
            steps, total = running_sum(values, total, modulus)
            lines.append(f"{key} {' '.join(map(str, values))} {steps}")
        return "\n".join(lines) + f"\nAnswer: {total:0{answer_width}d}{_END}"
    if modulus:
        raise ValueError("the per_list style demonstrates plain sums; use the copy style with a "
                         "modulus")
    lines, totals = [], []
    for key, values in lists:
        steps, total = running_sum(values)
        lines.append(f"{key} {steps}")
        totals.append(total)
    if len(totals) > 1:
        steps, _ = running_sum(totals)
        lines.append(steps)
    return "\n".join(lines) + f"\nAnswer: {sum(totals):0{answer_width}d}{_END}"


def add_answers(answers: Sequence[str], width: int = 0, answer_width: int = 0,
                style: str = "per_list", modulus: int = 0) -> str:
    """The turn after a spawn call: add the clones' answers as written, with running totals
    zero-padded to ``width`` digits (``+07=07 +11=18``), then give the total, zero-padded to
    ``answer_width`` digits. The ``copy`` style first copies the answers onto the line
    (``07 11 +07=07 +11=18``), as it copies lists; a ``modulus`` reduces every total."""
    total, steps = 0, []
    for answer in answers:
        total = _reduce(total + int(answer), modulus)
        steps.append(f"+{answer}={total:0{width}d}")
    copied = " ".join(answers) + " " if style == "copy" else ""
    return copied + " ".join(steps) + f"\nAnswer: {total:0{answer_width}d}{_END}"


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
    # A node holding more keys than this always delegates: a direct solution of that many
    # lists would not fit its context (None: no limit).
    max_direct_keys: int | None = None
    # Clones write their answer zero-padded to this many digits, and every node pads the
    # running totals of the turn in which it adds its clones' answers the same way (0: no
    # padding; a root's final answer is never padded). Every answer a parent reads then has
    # the same number of tokens and that turn has one fixed layout (``+07=07 +11=18``): a
    # tiny model copies and adds digits at fixed places far more reliably than one- or
    # two-digit numbers at places that shift.
    answer_width: int = 2
    # How a node solves its lists itself and adds its clones' answers: "per_list" or "copy"
    # (see `solve_lists` and `add_answers`).
    direct_style: str = "per_list"
    # The tasks' modulus (0: plain sums); a clone's prompt does not state it, so the teacher
    # is told.
    modulus: int = 0
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
        if self.direct_style not in DIRECT_STYLES:
            raise ValueError(f"direct_style must be one of {', '.join(DIRECT_STYLES)}, got "
                             f"{self.direct_style!r}")
        if self.max_direct_keys is not None and self.max_direct_keys < 1:
            raise ValueError(f"max_direct_keys must be >= 1 (or None), got {self.max_direct_keys}")
        self._rng = random.Random(self.seed)

    def __call__(self, prompt: str) -> str:
        user = _USER.search(prompt).group(1)
        is_root = not user.startswith("sum")
        assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
        returned = _RETURN.findall(assistant)
        width = 0 if is_root else self.answer_width
        if returned:  # resumed after the clones answered: add their answers
            return add_answers(returned[-1].split(TokenProtocol.SEP), self.answer_width, width,
                               self.direct_style, self.modulus)
        asked = _MODULUS.search(user)
        if is_root and (int(asked.group(1)) if asked else 0) != self.modulus:
            raise ValueError(f"the teacher demonstrates modulus {self.modulus}; this task asks "
                             f"{user!r}")
        keys_only = _KEYS_ONLY.match(user)
        if keys_only:  # a root that sees keys only
            return self._delegate(keys_only.group(1).split())
        lists = [(key, [int(v) for v in text.split()]) for key, text in _LIST.findall(user)]
        if not lists:
            raise ValueError(f"not a keyed_sum prompt: {user!r}")
        chance = self.delegate_inline if is_root else self.redelegate
        too_many = self.max_direct_keys is not None and len(lists) > self.max_direct_keys
        if len(lists) >= 2 and (too_many or self._rng.random() < chance):
            return self._delegate([key for key, _ in lists])
        return solve_lists(lists, width, self.direct_style, self.modulus)

    def _delegate(self, keys: list[str]) -> str:
        return spawn_call(split_keys(keys, self._rng.choice(self.branching)))
