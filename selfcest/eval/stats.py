"""Bootstrap confidence intervals for means over tasks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """A mean with its percentile-bootstrap confidence interval."""

    value: float  # the mean over tasks (the point estimate)
    low: float  # lower bound of the interval (the (1 - level) / 2 quantile of resampled means)
    high: float  # upper bound of the interval


def bootstrap_mean(
    values: Sequence[float],
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """The mean of ``values`` and its percentile-bootstrap confidence interval.

    Tasks are resampled with replacement ``resamples`` times. The generator is seeded, and
    the resampled indices depend only on ``len(values)``, ``resamples`` and ``seed``: every
    metric of one evaluation cell is resampled over the same task draws, so their intervals
    describe the same bootstrap replicates.
    """
    data = np.asarray(values, dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("bootstrap_mean needs a non-empty sequence of numbers")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, data.size, size=(resamples, data.size))
    means = data[draws].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Estimate(value=float(data.mean()), low=float(low), high=float(high))
