"""Tasks from `reasoning-gym` generators (offline, procedural, with their own scorers).

``gym_tasks("gsm_symbolic", size=200, seed=0)`` turns each entry of a reasoning-gym dataset
into a `Task`: the entry's question is the prompt and its answer the answer. The entry's
metadata is kept (made JSON-safe: fractions and other objects become strings, tuples lists)
together with the dataset name and config, so `selfcest.rewards.gym` can hand the model's
answer to the dataset's own ``score_answer``. Useful names: ``gsm_symbolic`` (GSM8K-style
templates), ``chain_sum``, ``basic_arithmetic``, ``family_relationships`` (multi-hop kinship).

reasoning-gym is an optional dependency (``pip install selfcest[gym]``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from selfcest.task import Task
from selfcest.tasks.chain_sum_teacher import parse_chain

SOURCE_PREFIX = "gym/"


def _json_safe(value: Any) -> Any:
    """The value after a JSON round trip, with unknown objects turned into strings."""
    return json.loads(json.dumps(value, default=str))


def gym_tasks(name: str, size: int, seed: int = 0, **config: Any) -> list[Task]:
    """``size`` entries of reasoning-gym dataset ``name`` built with ``seed`` and ``config``.

    Ids are ``gym-{name}-{seed}-{i}``. ``metadata`` holds ``gym_dataset`` (the name),
    ``gym_config`` (``config``, JSON-safe) and ``gym_metadata`` (the entry's metadata).
    Raises ValueError for an unknown dataset name or a rejected config.
    """
    import reasoning_gym  # optional dependency, imported only when gym tasks are asked for

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except (ValueError, TypeError, AssertionError) as error:
        raise ValueError(f"reasoning-gym dataset {name!r} with {config}: {error}") from error
    tasks = []
    for i in range(size):
        entry = dataset[i]
        tasks.append(
            Task(
                id=f"gym-{name}-{seed}-{i}",
                prompt=entry["question"],
                answer=str(entry["answer"]),
                source=SOURCE_PREFIX + name,
                metadata={
                    "gym_dataset": name,
                    "gym_config": _json_safe(config),
                    "gym_metadata": _json_safe(entry.get("metadata", {})),
                },
            )
        )
    return tasks


# reasoning-gym datasets are procedural, with no splits: a split is a far-apart seed range
# (entry i of a dataset is drawn with seed + i).
GYM_SPLIT_SEEDS = {"train": 0, "test": 1_000_000, "ood": 2_000_000}


def load_gym(dataset: str, size: int, seed: int = 0, split: str = "train",
             **config: Any) -> list[Task]:
    """``size`` tasks of ``split`` ("train", "test" or "ood": seeds a million apart) of the
    reasoning-gym ``dataset`` (the task source ``gym``)."""
    if split not in GYM_SPLIT_SEEDS:
        raise ValueError(f"gym split must be one of {', '.join(GYM_SPLIT_SEEDS)}, got {split!r}")
    return gym_tasks(dataset, size, seed + GYM_SPLIT_SEEDS[split], **config)


def gym_clone_answer(task: Task, objective: str, keys: Sequence[str]) -> str | None:
    """What a clone of a gym task should answer, where the dataset says: for ``chain_sum``,
    the value of the chain sum its objective ends with (a root that writes "Compute 4 - 7"
    asks for -3, right or wrong as a cut of its own task); None for other datasets and for
    objectives that end with no chain sum."""
    if task.metadata.get("gym_dataset") != "chain_sum":
        return None
    try:
        return str(sum(parse_chain(objective)))
    except ValueError:
        return None
