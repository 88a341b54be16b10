"""A reward function from a task scorer, cost shaping and the clone format rule.

``make_reward(scorer, cost)`` returns a `RewardFn` that, for one tree:

1. scores the root's final turn (`final_turn_text`) with ``scorer`` → task score s and
   correctness (reported unshaped in `RewardResult.correct`);
2. subtracts the cost terms (`selfcest.rewards.cost`): ``score = max(floor, s - P)``;
3. applies the clone format rule (`malformed_clones`): a clone whose sampled text has no
   case-insensitive ``Answer:`` and that generated more than ``format_tokens`` tokens is
   malformed (reference threshold: 192);
4. gives node rewards: the root gets ``score``; a clone gets ``clone_scale * score``
   (the reference math reward uses 0.4, the others 1.0), or, with ``clone_reward="own"``,
   ``clone_scale`` times the score of its own answer against what its task source says it
   should answer; ``malformed_clone_reward`` (0) when malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from selfcest.protocol import ANSWER_MARKER
from selfcest.rewards.base import RewardResult, TaskScorer, final_turn_text
from selfcest.rewards.cost import CostConfig, cost_terms, shape
from selfcest.task import Task
from selfcest.tasks import source_of
from selfcest.tree import CloneTree, Node

# The reference's format threshold: a clone may think this many tokens without an answer.
DEFAULT_FORMAT_TOKENS = 192


def malformed_clones(
    tree: CloneTree, max_tokens_without_answer: int = DEFAULT_FORMAT_TOKENS
) -> list[str]:
    """Ids of clones that wrote no ``Answer:`` (any case) in their sampled text and generated
    more than ``max_tokens_without_answer`` tokens (the reference's clone format rule)."""
    malformed = []
    for clone in tree.clones():
        sampled = "".join(s.text for s in clone.segments if s.trainable)
        too_long = clone.generated_tokens > max_tokens_without_answer
        if too_long and not ANSWER_MARKER.search(sampled):
            malformed.append(clone.id)
    return malformed


@dataclass(frozen=True)
class ComposedReward:
    """Task scorer + cost shaping + clone format rule, as a `RewardFn` (module docstring)."""

    scorer: TaskScorer  # (root final-turn text, task) -> TaskScore
    cost: CostConfig | Mapping[str, Any] | None = None  # None: no shaping
    format_tokens: int | None = DEFAULT_FORMAT_TOKENS  # None: no format rule
    clone_scale: float = 1.0  # a well-formed clone's reward is clone_scale * score
    malformed_clone_reward: float = 0.0  # reward of a malformed clone

    # "tree": a well-formed clone's reward is clone_scale * the tree's score (the reference);
    # "own": clone_scale * the scorer's score of the clone's own answer against what its
    # task source says it should answer from its objective and keys (`TaskSource.clone_answer`:
    # keyed_sum, reasoning-gym chain_sum; the tree's score where the source does not say). Only
    # credit strategies that read node rewards (ratio,
    # sibling) see the difference.
    clone_reward: str = "tree"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", CostConfig.from_value(self.cost))
        if self.clone_reward not in ("tree", "own"):
            raise ValueError(f"clone_reward must be 'tree' or 'own', got {self.clone_reward!r}")

    def __call__(self, tree: CloneTree, task: Task) -> RewardResult:
        task_score = self.scorer(final_turn_text(tree), task)
        terms: dict[str, float] = {}
        score, penalty = task_score.score, 0.0
        if self.cost is not None:
            terms = cost_terms(tree, self.cost)
            score, penalty = shape(task_score.score, terms, self.cost)
        malformed = (
            malformed_clones(tree, self.format_tokens) if self.format_tokens is not None else []
        )
        node_rewards = {tree.ROOT_ID: score}
        for clone in tree.clones():
            well_formed = clone.id not in malformed
            node_rewards[clone.id] = (
                self.clone_scale * self._clone_score(clone, task, score) if well_formed
                else self.malformed_clone_reward
            )
        info = {"task_score": task_score.score, **task_score.info, **terms, "cost/total": penalty}
        return RewardResult(score, task_score.correct, node_rewards, malformed, info)


    def _clone_score(self, clone: Node, task: Task, tree_score: float) -> float:
        source = source_of(task)
        if self.clone_reward == "tree" or source is None or source.clone_answer is None:
            return tree_score
        expected = source.clone_answer(task, clone.objective or "", clone.context_keys)
        if expected is None:
            return tree_score
        return self.scorer(clone.final_text, replace(task, answer=expected)).score


def make_reward(
    task_scorer: TaskScorer,
    cost: CostConfig | Mapping[str, Any] | None = None,
    *,
    format_tokens: int | None = DEFAULT_FORMAT_TOKENS,
    clone_scale: float = 1.0,
    malformed_clone_reward: float = 0.0,
) -> ComposedReward:
    """A `RewardFn`: ``task_scorer`` minus ``cost``, with the clone format rule (see module).

    ``info`` carries ``task_score``, the scorer's own components, each ``cost/<term>`` and
    ``cost/total``.
    """
    return ComposedReward(task_scorer, cost, format_tokens, clone_scale, malformed_clone_reward)
