"""Tasks: the typed record, generators, loaders, and a registry configs refer to by name.

``load_tasks(name, **kwargs)`` returns a list of `Task`; its docstring tables the sources
and their arguments.

`check_params` checks a source's arguments against its loader's signature (unknown or
missing arguments, types, paths that do not exist) before anything is generated or read.

Each source is a `TaskSource` (its loader, and the hooks experiments use, such as how a
monolithic twin sees its tasks); sources with a scripted warm-start teacher keep it in a
module beside them (`TEACHERS`). reasoning-gym and pyarrow, optional, are imported only by
the sources that read them.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from selfcest.task import Task
from selfcest.tasks.arithmetic import load_arithmetic
from selfcest.tasks.chain_sum_teacher import ChainSumTeacher
from selfcest.tasks.gym import gym_clone_answer, load_gym
from selfcest.tasks.io import MalformedRowError, load_jsonl, write_jsonl
from selfcest.tasks.keyed_sum import inline_view, keys_answer, load_keyed_sum
from selfcest.tasks.keyed_sum_teacher import KeyedSumTeacher
from selfcest.tasks.math import load_aime_split, load_math_hard
from selfcest.tasks.multihop import load_2wiki, load_musique

__all__ = ["Task", "TaskSource", "MalformedRowError", "load_jsonl", "write_jsonl", "load_tasks",
           "check_params", "source_of", "TASKS", "TEACHERS"]


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
        raise ValueError(f"{key} must be a list or a mapping of {{name, params, repeat}}; got "
                         f"{sources!r}")
    pairs = list(sources.items() if isinstance(sources, Mapping) else enumerate(sources))
    for label, source in pairs:
        unknown = (set(source) - {"name", "params", "repeat"} if isinstance(source, Mapping)
                   else set())
        if not isinstance(source, Mapping) or "name" not in source or unknown:
            raise ValueError(f"{key}.{label} must be {{name, params, repeat}}; got {source!r}")
    return pairs


@dataclass(frozen=True)
class TaskSource:
    """One kind of task: its loader, and what experiments need to know of it."""

    # Loader: keyword arguments (the config's task.params) -> tasks.
    load: Callable[..., list[Task]]
    # How a monolithic solver sees one of these tasks, with everything it needs in its own
    # prompt (keyed_sum: the lists printed inline); None: as the clone arm sees it.
    monolithic_view: Callable[[Task], Task] | None = None
    # What the clone arm's root sees, in a sentence for reports ("" if nothing to say).
    clone_view: str = ""
    # The answer a clone of a task should give, from its objective and the context keys it
    # was handed (None: the task does not say), for rewards that score each clone on its
    # own job.
    clone_answer: Callable[[Task, str, Sequence[str]], str | None] | None = None


def _keyed_sum_clone_answer(task: Task, objective: str, keys: Sequence[str]) -> str | None:
    return keys_answer(task, keys)  # the lists it was handed decide, whatever it was told


TASKS: dict[str, TaskSource] = {
    "keyed_sum": TaskSource(
        load_keyed_sum, monolithic_view=inline_view, clone_answer=_keyed_sum_clone_answer,
        clone_view="the clone arm's root sees the keys only and reads a list through a clone; "
                   "the monolithic twin gets the lists printed in its prompt"),
    "arithmetic": TaskSource(load_arithmetic),
    "jsonl": TaskSource(load_jsonl),
    "aime": TaskSource(load_aime_split),
    "math_hard": TaskSource(load_math_hard),
    "2wiki": TaskSource(load_2wiki),
    "musique": TaskSource(load_musique),
    "gym": TaskSource(load_gym, clone_answer=gym_clone_answer),
    "mix": TaskSource(_mix),
}

# Scripted teachers that write warm-start demonstrations, by the name a warm_start config
# gives (`selfcest.train.traces.demonstrations`).
TEACHERS: dict[str, type] = {"keyed_sum": KeyedSumTeacher, "chain_sum": ChainSumTeacher}


def source_of(task: Task) -> TaskSource | None:
    """The source a task came from: its ``source`` names it, or names a dataset of it after
    a slash (reasoning-gym tasks are ``gym/<dataset>``); None for a source not registered."""
    return TASKS.get(task.source) or TASKS.get(task.source.partition("/")[0])


def load_tasks(name: str, /, **kwargs: Any) -> list[Task]:
    """The tasks of source ``name``, a list of `Task`:

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

    Unknown names and bad arguments raise ValueError before anything is generated or read
    (`check_params`).
    """
    try:
        check_params(name, kwargs)
    except ValueError as error:
        raise ValueError(f"load_tasks({name!r}): {error}") from None
    return TASKS[name].load(**kwargs)


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
    loader = TASKS[name].load
    parameters = inspect.signature(loader).parameters
    hints = typing.get_type_hints(loader)
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
            raise ValueError(f"{where}.name: unknown task source {source['name']!r}; known: "
                             f"{', '.join(TASKS)}")
        check_params(source["name"], source.get("params") or {},
                     lambda arg: f"{where}.params.{arg}")


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
