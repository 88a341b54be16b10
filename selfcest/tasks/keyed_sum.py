"""keyed_sum: a small synthetic long-context task for CPU experiments.

The task holds ``num_keys`` lists of small numbers under keys ``L1 … Ln``. The root is asked
for the total of all numbers but, by default, sees only the keys::

    Add all numbers in L1 L2 L3 L4.

and each key's numbers (``"3 5 2 7"``) live in `Task.context`, so they reach a clone only when
the parent hands it the key (``@L2`` in the token protocol). `keyed_sum_task` describes the
inline layout, the answer and ``modulus``.

`keyed_sum_splits` gives disjoint in-distribution train/test splits and an
out-of-distribution split (by default two more keys: 6 instead of 4).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from selfcest.task import Task, context_block
from selfcest.tasks.splits import TaskSplits, config_of, draw_distinct

SOURCE = "keyed_sum"
# A key must be referable as ``@KEY`` by the token protocol, so the prefix is a plain name.
_PREFIX = re.compile(r"[A-Za-z_]+")
# Letter keys in order; A is left out (it begins "Add" and "Answer"), and so are I, L and O.
KEY_LETTERS = "BCDEFGHJKMNPQRSTUVWXYZ"


@dataclass(frozen=True)
class KeyedSumConfig:
    """Difficulty knobs of keyed_sum."""

    num_keys: int = 4  # number of lists (keys L1..Ln)
    list_len: int = 4  # numbers per list
    min_value: int = 0  # smallest number (inclusive)
    max_value: int = 9  # largest number (inclusive); 99 gives two-digit numbers
    inline: bool = False  # print the lists in the root prompt instead of keys only
    key_prefix: str = "L"  # keys are f"{key_prefix}{i}", i = 1..num_keys
    # Keys are single letters instead (B, C, D, ...: `KEY_LETTERS`). A tiny tokenizer splits
    # "L2" into "L" and "2", and the "2" also stands for a value: finding list L2 in a prompt
    # full of digits is then a two-token match a 2-layer model learns late, if at all.
    letter_keys: bool = False
    # Answer the total modulo this (0: the plain total). With 10, every partial result is
    # one digit, so each step of a running sum is the same small operation at every level.
    modulus: int = 0

    def __post_init__(self) -> None:
        if self.num_keys < 1 or self.list_len < 1:
            raise ValueError("num_keys and list_len must be at least 1")
        if self.modulus < 0:
            raise ValueError(f"modulus must be >= 0 (0: no modulus), got {self.modulus}")
        if self.letter_keys and self.num_keys > len(KEY_LETTERS):
            raise ValueError(f"letter_keys allows at most {len(KEY_LETTERS)} keys, got "
                             f"{self.num_keys}")
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        if not _PREFIX.fullmatch(self.key_prefix):
            raise ValueError(
                f"key_prefix must be letters or underscores (a key is referenced as @KEY), "
                f"got {self.key_prefix!r}"
            )

    def keys(self) -> list[str]:
        if self.letter_keys:
            return list(KEY_LETTERS[: self.num_keys])
        return [f"{self.key_prefix}{i}" for i in range(1, self.num_keys + 1)]

    def space_size(self) -> int:
        """Number of distinct tasks this config can produce."""
        return (self.max_value - self.min_value + 1) ** (self.num_keys * self.list_len)


def keyed_sum_task(lists: list[list[int]], config: KeyedSumConfig, task_id: str) -> Task:
    """The task whose key ``L{i}`` holds ``lists[i-1]``.

    A tiny model reads these prompts, so they are kept short and regular. With ``inline=True``
    the numbers are printed in the prompt itself (for a monolithic baseline that reads
    everything in one context), in the same ``[key] text`` layout clones get for an expanded
    key::

        Add all numbers.
        [L1] 3 5 2 7
        [L2] 0 9 4 1

    The answer is the total as a decimal string; ``metadata["sums"]`` holds each key's sum (the
    answer a clone asked to sum one key should give). With ``modulus=10`` the prompt ends in
    ``mod 10.`` and every answer (the total, each key's sum) is taken modulo 10.
    """
    keys = config.keys()
    if len(lists) != len(keys):
        raise ValueError(f"expected {len(keys)} lists, got {len(lists)}")
    context = {key: " ".join(str(v) for v in values) for key, values in zip(keys, lists)}
    modulo = f" mod {config.modulus}" if config.modulus else ""
    if config.inline:
        prompt = f"Add all numbers{modulo}.\n" + context_block(keys, context)
    else:
        prompt = f"Add all numbers in {' '.join(keys)}{modulo}."

    def reduce(value: int) -> int:
        return value % config.modulus if config.modulus else value

    sums = {key: reduce(sum(values)) for key, values in zip(keys, lists)}
    return Task(
        id=task_id,
        prompt=prompt,
        answer=str(reduce(sum(sums.values()))),
        context=context,
        source=SOURCE,
        metadata={"sums": sums, "config": asdict(config)},
    )


def _distinct_lists(
    n: int, seed: int | str, config: KeyedSumConfig, seen: set
) -> list[list[list[int]]]:
    """``n`` draws of lists not in ``seen`` (updated), from ``random.Random(seed)``."""
    if n > config.space_size():
        raise ValueError(f"{config} has only {config.space_size()} distinct tasks, asked for {n}")

    def draw(rng: random.Random) -> tuple[Any, list[list[int]]]:
        lists = [
            [rng.randint(config.min_value, config.max_value) for _ in range(config.list_len)]
            for _ in range(config.num_keys)
        ]
        return tuple(tuple(values) for values in lists), lists

    return draw_distinct(draw, random.Random(seed), n, seen, "keyed_sum tasks")


def keyed_sum_tasks(
    n: int, seed: int | str = 0, config: KeyedSumConfig | None = None, id_prefix: str = "keyed_sum"
) -> list[Task]:
    """``n`` distinct tasks drawn with ``random.Random(seed)``; ids ``{id_prefix}-{i}``."""
    config = config or KeyedSumConfig()
    drawn = _distinct_lists(n, seed, config, set())
    return [keyed_sum_task(lists, config, f"{id_prefix}-{i}") for i, lists in enumerate(drawn)]


def keyed_sum_splits(
    seed: int = 0,
    train: KeyedSumConfig | None = None,
    ood: KeyedSumConfig | None = None,
    n_train: int = 1000,
    n_test: int = 200,
    n_ood: int = 200,
) -> TaskSplits:
    """Train/test from ``train`` (default `KeyedSumConfig()`), OOD from ``ood``.

    The default ``ood`` is ``train`` with two more keys (6 instead of 4: a longer context,
    more to delegate). Deterministic for a seed. Train and test come from one seeded stream (the
    first ``n_train`` distinct tasks are train, the next ``n_test`` test), OOD from a second
    stream derived from the seed, so changing ``n_test`` or ``n_ood`` never changes the train
    split. The three are disjoint: a task (its lists) never appears twice, even when ``ood``
    equals ``train``. Ids: ``keyed_sum-{split}-{i}``.
    """
    train = train or KeyedSumConfig()
    ood = ood or replace(train, num_keys=train.num_keys + 2)
    seen: set = set()
    in_dist = _distinct_lists(n_train + n_test, seed, train, seen)
    # random.Random hashes a str seed with SHA-512, so this stream is stable across runs.
    out_dist = _distinct_lists(n_ood, f"{seed}:ood", ood, seen)

    def tasks(drawn: list, config: KeyedSumConfig, split: str) -> list[Task]:
        return [keyed_sum_task(x, config, f"keyed_sum-{split}-{i}") for i, x in enumerate(drawn)]

    return TaskSplits(
        train=tasks(in_dist[:n_train], train, "train"),
        test=tasks(in_dist[n_train:], train, "test"),
        ood=tasks(out_dist, ood, "ood"),
    )


def keys_answer(task: Task, keys: Sequence[str]) -> str | None:
    """What a clone handed ``keys`` should answer: the total of those lists (modulo the
    task's modulus); None without keys or with a key the task does not hold."""
    sums = task.metadata["sums"]
    if not keys or any(key not in sums for key in keys):
        return None
    modulus = task.metadata["config"]["modulus"]
    total = sum(sums[key] for key in keys)
    return str(total % modulus if modulus else total)


def inline_view(task: Task) -> Task:
    """The same keyed_sum task with its lists printed in the prompt (for a monolithic
    baseline reading everything in one context); the answer and context are unchanged."""
    config = KeyedSumConfig(**task.metadata["config"])
    if config.inline:
        return task
    lists = [[int(v) for v in task.context[key].split()] for key in config.keys()]
    return keyed_sum_task(lists, replace(config, inline=True), task.id)


def load_keyed_sum(
    split: str = "train",
    seed: int = 0,
    n_train: int = 1000,
    n_test: int = 200,
    n_ood: int = 200,
    train: Any = None,
    ood: Any = None,
    sizes: list[int] | None = None,
) -> list[Task]:
    """The ``split`` ("train", "test" or "ood") of `keyed_sum_splits`; ``train`` / ``ood`` are
    `KeyedSumConfig`s or mappings of their fields (the task source ``keyed_sum``).

    ``sizes`` (numbers of keys) makes the train and test splits hold ``n_train`` / ``n_test``
    tasks of each size, ``train`` with its ``num_keys`` replaced by the size, ids
    ``keyed_sum-{split}-{size}k-{i}``; the OOD split is ``ood`` as without sizes.
    """
    train, ood = config_of(KeyedSumConfig, train), config_of(KeyedSumConfig, ood)
    if sizes is None or split == "ood":
        return keyed_sum_splits(seed, train, ood, n_train, n_test, n_ood)[split]
    tasks = []
    for size in sizes:
        shaped = replace(train or KeyedSumConfig(), num_keys=size)
        for i, task in enumerate(keyed_sum_splits(seed, shaped, ood, n_train, n_test, 0)[split]):
            tasks.append(replace(task, id=f"keyed_sum-{split}-{size}k-{i}"))
    return tasks
