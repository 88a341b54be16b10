"""Seeded splitting helpers shared by generators and loaders."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from selfcest.task import Task

T = TypeVar("T")

SPLITS = ("train", "test", "ood")


@dataclass
class TaskSplits:
    """Disjoint splits of a generator: in-distribution train and test, out-of-distribution."""

    train: list[Task] = field(default_factory=list)
    test: list[Task] = field(default_factory=list)
    ood: list[Task] = field(default_factory=list)

    def __getitem__(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise KeyError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        return getattr(self, split)


# Draws allowed per requested item before `draw_distinct` gives up: generous enough that a
# space much larger than the request never hits it, small enough to fail fast otherwise.
ATTEMPTS_PER_ITEM = 50


def draw_distinct(
    draw: Callable[[random.Random], tuple[Hashable, T]],
    rng: random.Random,
    n: int,
    seen: set[Hashable],
    what: str,
) -> list[T]:
    """Draw ``n`` items whose keys are not in ``seen`` (which is updated).

    ``draw(rng)`` returns ``(key, item)``; two items with the same key are the same task, so
    sharing ``seen`` between calls keeps splits disjoint. Raises ValueError when the space
    looks exhausted (``ATTEMPTS_PER_ITEM * n + 1000`` draws without reaching ``n``).
    """
    items: list[T] = []
    attempts = ATTEMPTS_PER_ITEM * n + 1000
    while len(items) < n:
        if attempts == 0:
            raise ValueError(
                f"could only draw {len(items)} of {n} distinct {what}: the space is too small "
                "for this many tasks (widen the knobs or ask for fewer)"
            )
        attempts -= 1
        key, item = draw(rng)
        if key not in seen:
            seen.add(key)
            items.append(item)
    return items


def random_split(items: Sequence[T], test_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Shuffle with ``random.Random(seed)`` and cut: ``round(len * test_fraction)`` go to test.

    Returns (train, test), each in the original order of ``items``.
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    test_idx = set(order[: round(len(items) * test_fraction)])
    train = [item for i, item in enumerate(items) if i not in test_idx]
    test = [item for i, item in enumerate(items) if i in test_idx]
    return train, test


def config_of(cls: type, value: Any) -> Any:
    """A generator's config dataclass from an instance, a mapping of its fields (Hydra), or
    None (the generator's default)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} or a mapping of its fields, got {value!r}")
