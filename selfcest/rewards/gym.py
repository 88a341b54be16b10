"""reasoning-gym answers scored by the dataset's own ``score_answer``.

For a task made by `selfcest.tasks.gym.gym_tasks`, the root's final-turn ``Answer:`` line
(`selfcest.protocol.extract_answer`) is handed to ``score_answer(answer, entry)`` of the
dataset named in ``task.metadata["gym_dataset"]``, built with the task's config; ``entry``
is rebuilt from the task (question, answer, the entry's metadata). The dataset's score (in
[0, 1]; some datasets give partial scores) is the task score; correct means a score of 1.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from selfcest.protocol import extract_answer
from selfcest.rewards.base import TaskScore
from selfcest.rewards.compose import ComposedReward
from selfcest.rewards.cost import CostConfig
from selfcest.task import Task


@functools.lru_cache(maxsize=64)
def _score_fn(name: str, config_json: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym  # optional dependency

    # Only the dataset's scorer is used, so one entry is enough.
    dataset = reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))
    return dataset.score_answer


@dataclass(frozen=True)
class GymScorer:
    """Task scorer delegating to the reasoning-gym dataset the task came from."""

    def __call__(self, text: str, task: Task) -> TaskScore:
        if "gym_dataset" not in task.metadata:
            raise ValueError(f"task {task.id} was not made by gym_tasks (no gym_dataset)")
        config = json.dumps(task.metadata.get("gym_config", {}), sort_keys=True)
        score_answer = _score_fn(task.metadata["gym_dataset"], config)
        entry = {
            "question": task.prompt,
            "answer": task.answer,
            "metadata": task.metadata.get("gym_metadata", {}),
        }
        answer = extract_answer(text)
        score = float(score_answer(answer or None, entry))
        return TaskScore(score, score >= 1.0, {"answer_missing": float(not answer)})


def gym_reward(*, cost: CostConfig | dict | None = None, **options: Any) -> ComposedReward:
    """The gym scorer minus ``cost`` (default: none); ``options`` go to `ComposedReward`."""
    return ComposedReward(GymScorer(), cost, **options)
