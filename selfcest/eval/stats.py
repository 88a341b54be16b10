"""Bootstrap confidence intervals for means over tasks, and for fractions over groups of items."""

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
    means = data[_draws(data.size, resamples, level, seed)].mean(axis=1)
    return Estimate(float(data.mean()), *_percentiles(means, level))


def bootstrap_ratio(
    numerators: Sequence[float],
    denominators: Sequence[float],
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """``sum(numerators) / sum(denominators)`` and its percentile-bootstrap interval, the
    (numerator, denominator) pairs resampled with replacement.

    The interval of a fraction of items that come in groups whose items are not independent
    (the spawn calls of one tree: a root that retries a bad call tends to fail again): each
    group is one pair (items that count, items), and groups are resampled, not items. The
    draws are those `bootstrap_mean` makes for as many values.
    """
    top, bottom = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if top.ndim != 1 or top.shape != bottom.shape or top.size == 0:
        raise ValueError(
            "bootstrap_ratio needs non-empty numerators and denominators of one length")
    if (bottom <= 0).any():
        raise ValueError("bootstrap_ratio needs positive denominators (leave out groups with no "
                         "items)")
    draws = _draws(top.size, resamples, level, seed)
    ratios = top[draws].sum(axis=1) / bottom[draws].sum(axis=1)
    return Estimate(float(top.sum() / bottom.sum()), *_percentiles(ratios, level))


def _draws(size: int, resamples: int, level: float, seed: int) -> np.ndarray:
    """Indices of ``resamples`` resamples of ``size`` items, seeded."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return np.random.default_rng(seed).integers(0, size, size=(resamples, size))


def _percentiles(statistics: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(statistics, [tail, 100 - tail])
    return float(low), float(high)
