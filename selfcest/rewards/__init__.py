"""Rewards: one global score per clone tree from the root's final answer, minus cost shaping.

Ready-made rewards (factories; keyword arguments configure them, and `load_reward` calls
them when given as a spec, e.g. ``"selfcest.rewards.arithmetic:arithmetic_reward"``):

- `selfcest.rewards.arithmetic.arithmetic_reward`: integer exact match (arithmetic,
  keyed_sum), optional partial credit;
- `selfcest.rewards.math.math_reward`: math-verify, hang-proof;
- `selfcest.rewards.qa.qa_reward`: exact match / token F1 with aliases;
- `selfcest.rewards.gym.gym_reward`: reasoning-gym's own scorers.

Each is a `ComposedReward` of a task scorer, a `CostConfig` and the clone format rule; build
others with `make_reward`.
"""

from selfcest.rewards.base import (
    RewardFn,
    RewardResult,
    TaskScore,
    TaskScorer,
    final_turn_text,
    load_reward,
    score_trees,
)
from selfcest.rewards.compose import ComposedReward, make_reward, malformed_clones
from selfcest.rewards.cost import (
    MATH_REFERENCE_COST,
    NO_CLONE_REFERENCE_COST,
    CostConfig,
    SaturatingPenalty,
    SpawnCallPenalty,
    cost_terms,
)

__all__ = [
    "RewardFn",
    "RewardResult",
    "TaskScore",
    "TaskScorer",
    "final_turn_text",
    "load_reward",
    "score_trees",
    "ComposedReward",
    "make_reward",
    "malformed_clones",
    "CostConfig",
    "SaturatingPenalty",
    "SpawnCallPenalty",
    "MATH_REFERENCE_COST",
    "NO_CLONE_REFERENCE_COST",
    "cost_terms",
]
