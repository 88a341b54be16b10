"""Learning-rate schedules, as multipliers of the peak rate per optimizer step (for
`torch.optim.lr_scheduler.LambdaLR`); shared by GRPO and the warm start."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(schedule: str, warmup: int, total: int, floor: float = 0.0) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then constant, or linear / cosine decay from 1
    to ``floor`` at step ``total``."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        if schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor
