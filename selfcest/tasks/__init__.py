"""Tasks: the typed record, generators, loaders, and a registry configs refer to by name.

``load_tasks(name, **kwargs)`` returns a list of `Task`:

========== =====================================================================
name       arguments (defaults)
========== =====================================================================
keyed_sum  split ("train" | "test" | "ood"), seed (0), n_train (1000), n_test (200),
           n_ood (200), train / ood (`KeyedSumConfig` or a mapping of its fields)
arithmetic split, seed (0), n_train (900), n_test (100), n_ood (0), train / ood
           (`ArithmeticConfig` or a mapping)
jsonl      path: a file written by the ``scripts/prepare_*.py`` scripts, or one of your own
           (docs/datasets.md)
aime       path (CSV), split ("train" | "test"), test_fraction (0.1), seed (42)
math_hard  root (folder with train/ and test/), split
2wiki      path (one split file)
musique    path (one split file)
gym        dataset (a reasoning-gym name), size, seed (0), split ("train" | "test" | "ood":
           seeds a million apart), any dataset config field
mix        sources: a list, or a mapping of names, of {name, params, repeat (1)}: each
           source's tasks repeated ``repeat`` times, ids prefixed by the position or name
========== =====================================================================

`check_params` checks a source's arguments against its loader's signature (unknown or
missing arguments, types, paths that do not exist) before anything is generated or read.

The loaders of each source import lazily: the synthetic tasks use `selfcest.protocol`
(which itself imports `selfcest.tasks.base`, so an eager import here would be circular), and
reasoning-gym and pyarrow are only needed by the sources that read them.
"""

from __future__ import annotations

import inspect
import types
import typing
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


def _mix(sources: list[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]) -> list[Task]:
    tasks: list[Task] = []
    for label, source in _mix_sources(sources, "sources"):
        loaded = [replace(task, id=f"{label}/{task.id}")
                  for task in load_tasks(source["name"], **dict(source.get("params") or {}))]
        tasks += loaded * int(source.get("repeat", 1))
    return tasks


def _mix_sources(sources: Any, key: str) -> list[tuple[Any, Mapping[str, Any]]]:
    """``(label, source)`` pairs of a mix: a list's labels are the positions, a mapping's its
    names (``aime: {...}``, which a command line can address as ``sources.aime.params.path``).
    Each source is ``{name, params, repeat}``; errors name ``key.label``."""
    if not isinstance(sources, (list, tuple, Mapping)):
        raise ValueError(f"{key} must be a list or a mapping of {{name, params, repeat}}; got {sources!r}")
    pairs = list(sources.items() if isinstance(sources, Mapping) else enumerate(sources))
    for label, source in pairs:
        unknown = set(source) - {"name", "params", "repeat"} if isinstance(source, Mapping) else set()
        if not isinstance(source, Mapping) or "name" not in source or unknown:
            raise ValueError(f"{key}.{label} must be {{name, params, repeat}}; got {source!r}")
    return pairs


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

    Unknown names and bad arguments raise ValueError before anything is generated or read
    (`check_params`).
    """
    try:
        check_params(name, kwargs)
    except ValueError as error:
        raise ValueError(f"load_tasks({name!r}): {error}") from None
    return TASKS[name](**kwargs)


def check_params(name: str, params: Mapping[str, Any], key: Callable[[str], str] = str) -> None:
    """Check source ``name``'s arguments without generating or reading any task.

    Raises ValueError for an unknown source, an argument the loader does not take, a
    required one that is missing, a value whose type does not fit the loader's annotation,
    or a path that does not exist. The message starts with the argument's name as
    ``key(arg)`` gives it (a config passes ``task.params.path`` and the like) and says the
    fix. The sources of a ``mix`` are checked one by one, each argument named
    ``<sources>.<label>.params.<arg>``.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task source {name!r}; known: {', '.join(TASKS)}")
    parameters = inspect.signature(TASKS[name]).parameters
    hints = typing.get_type_hints(TASKS[name])
    named = {arg: p for arg, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
    for arg in params:  # first: a misspelt argument explains a missing one
        if arg not in named and len(named) == len(parameters):  # no **kwargs to take it
            raise ValueError(f"{key(arg)}: task source {name!r} takes no {arg!r} "
                             f"(it takes {', '.join(named) or 'nothing'}); remove it")
    for arg, parameter in named.items():
        if parameter.default is parameter.empty and arg not in params:
            raise ValueError(f"{key(arg)} is required by task source {name!r}: set {key(arg)}=...")
    for arg, value in params.items():
        if not _fits(value, hints.get(arg, Any)):
            raise ValueError(f"{key(arg)} must be {parameters[arg].annotation}; got {value!r}")
        if _is_path(hints.get(arg)) and not Path(value).exists():
            raise ValueError(f"{key(arg)}: no file or folder {str(value)!r}; set {key(arg)}=<path>")
    if name == "mix":
        _check_mix(params["sources"], key("sources"))


def _check_mix(sources: Any, key: str) -> None:
    for label, source in _mix_sources(sources, key):
        where = f"{key}.{label}"
        repeat = source.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ValueError(f"{where}.repeat must be a whole number >= 1; got {repeat!r}")
        if source["name"] not in TASKS:
            raise ValueError(f"{where}.name: unknown task source {source['name']!r}; known: {', '.join(TASKS)}")
        check_params(source["name"], source.get("params") or {}, lambda arg: f"{where}.params.{arg}")


def _fits(value: Any, hint: Any) -> bool:
    """Whether a config value fits a loader's annotation: a path may be given as a string,
    an int is no bool, a float may be an int; parameters of generics are not checked."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    kind = typing.get_origin(hint) or hint
    if kind is Path:
        return isinstance(value, (str, Path))
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return value is None if hint is type(None) else isinstance(value, kind)


def _is_path(hint: Any) -> bool:
    return hint is Path or Path in typing.get_args(hint)
