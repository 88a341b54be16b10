"""Tasks: the typed record, generators, loaders, and a registry configs refer to by name.

``load_tasks(name, **kwargs)`` returns a list of `Task`:

========== =====================================================================
name       arguments (defaults)
========== =====================================================================
keyed_sum  split ("train" | "test" | "ood"), seed (0), n_train (1000), n_test (200),
           n_ood (200), train / ood (`KeyedSumConfig` or a mapping of its fields)
arithmetic split, seed (0), n_train (900), n_test (100), n_ood (0), train / ood
           (`ArithmeticConfig` or a mapping)
jsonl      path: a file written by the ``scripts/prepare_*.py`` scripts
aime       path (CSV), split ("train" | "test"), test_fraction (0.1), seed (42)
math_hard  root (folder with train/ and test/), split
2wiki      path (one split file)
musique    path (one split file)
gym        dataset (a reasoning-gym name), size, seed (0), split ("train" | "test" | "ood":
           seeds a million apart), any dataset config field
========== =====================================================================

The loaders of each source import lazily: the synthetic tasks use `selfcest.protocol`
(which itself imports `selfcest.tasks.base`, so an eager import here would be circular), and
reasoning-gym and pyarrow are only needed by the sources that read them.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from selfcest.tasks.base import Task
from selfcest.tasks.io import MalformedRowError, load_jsonl, write_jsonl

__all__ = ["Task", "MalformedRowError", "load_jsonl", "write_jsonl", "load_tasks", "TASKS"]


def _config(cls: type, value: Any) -> Any:
    """A config dataclass from an instance, a mapping of its fields (Hydra), or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} or a mapping of its fields, got {value!r}")


def _keyed_sum(
    split: str = "train",
    seed: int = 0,
    n_train: int = 1000,
    n_test: int = 200,
    n_ood: int = 200,
    train: Any = None,
    ood: Any = None,
) -> list[Task]:
    from selfcest.tasks.keyed_sum import KeyedSumConfig, keyed_sum_splits

    splits = keyed_sum_splits(
        seed, _config(KeyedSumConfig, train), _config(KeyedSumConfig, ood), n_train, n_test, n_ood
    )
    return splits[split]


def _arithmetic(
    split: str = "train",
    seed: int = 0,
    n_train: int = 900,
    n_test: int = 100,
    n_ood: int = 0,
    train: Any = None,
    ood: Any = None,
) -> list[Task]:
    from selfcest.tasks.arithmetic import ArithmeticConfig, arithmetic_splits

    splits = arithmetic_splits(
        seed, _config(ArithmeticConfig, train), _config(ArithmeticConfig, ood),
        n_train, n_test, n_ood,
    )
    return splits[split]


def _aime(
    path: str | Path, split: str = "train", test_fraction: float = 0.1, seed: int = 42
) -> list[Task]:
    from selfcest.tasks.math import aime_splits

    return aime_splits(path, test_fraction, seed)[split]


def _math_hard(root: str | Path, split: str) -> list[Task]:
    from selfcest.tasks.math import load_math_hard

    return load_math_hard(root, split)


def _2wiki(path: str | Path) -> list[Task]:
    from selfcest.tasks.multihop import load_2wiki

    return load_2wiki(path)


def _musique(path: str | Path) -> list[Task]:
    from selfcest.tasks.multihop import load_musique

    return load_musique(path)


# reasoning-gym datasets are procedural, with no splits: a split is a far-apart seed range
# (entry i of a dataset is drawn with seed + i).
_GYM_SPLIT_SEEDS = {"train": 0, "test": 1_000_000, "ood": 2_000_000}


def _gym(dataset: str, size: int, seed: int = 0, split: str = "train", **config: Any) -> list[Task]:
    from selfcest.tasks.gym import gym_tasks

    if split not in _GYM_SPLIT_SEEDS:
        raise ValueError(f"gym split must be one of {', '.join(_GYM_SPLIT_SEEDS)}, got {split!r}")
    return gym_tasks(dataset, size, seed + _GYM_SPLIT_SEEDS[split], **config)


def _mix(sources: list[Mapping[str, Any]]) -> list[Task]:
    tasks: list[Task] = []
    for n, source in enumerate(sources):
        unknown = set(source) - {"name", "params", "repeat"}
        if "name" not in source or unknown:
            raise ValueError(f"mix source {n}: expected {{name, params, repeat}}, got {dict(source)}")
        loaded = [replace(task, id=f"{n}/{task.id}")
                  for task in load_tasks(source["name"], **dict(source.get("params") or {}))]
        tasks += loaded * int(source.get("repeat", 1))
    return tasks


TASKS: dict[str, Callable[..., list[Task]]] = {
    "keyed_sum": _keyed_sum,
    "arithmetic": _arithmetic,
    "jsonl": load_jsonl,
    "aime": _aime,
    "math_hard": _math_hard,
    "2wiki": _2wiki,
    "musique": _musique,
    "gym": _gym,
    "mix": _mix,
}


def load_tasks(name: str, /, **kwargs: Any) -> list[Task]:
    """The tasks of source ``name`` (see the table in this module's docstring).

    Unknown names and arguments raise ValueError before anything is generated or read.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task source {name!r}; known: {', '.join(TASKS)}")
    loader = TASKS[name]
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as error:
        raise ValueError(f"load_tasks({name!r}): {error}") from None
    return loader(**kwargs)
