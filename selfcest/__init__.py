"""selfcest: train language models to delegate to clones of themselves.

The public API, for notebooks and scripts::

    from selfcest import ClonePolicy, Budget, SamplingParams
    policy = ClonePolicy.build_tiny()
    tree = policy.solve("Add all numbers in L1 L2.", context={"L1": "1 2", "L2": "3 4"})

Training: `selfcest.train.trainer.GRPOTrainer` with `selfcest.train.config.TrainConfig`, or
the ``selfcest-train`` command.
"""

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.protocol import TokenProtocol, ToolCallProtocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tree import CloneTree

__all__ = [
    "Budget",
    "ClonePolicy",
    "CloneTree",
    "RolloutEngine",
    "SamplingParams",
    "Task",
    "TokenProtocol",
    "ToolCallProtocol",
]
__version__ = "0.1.0"
