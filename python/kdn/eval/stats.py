"""Confidence for evaluation scores: bootstrap intervals of a mean and of a paired difference."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(values, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (``(nan, nan)`` when empty).

    Example:
        >>> bootstrap_ci([1, 0, 1, 1])
        (0.25, 1.0)
    """
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    means = x[np.random.default_rng(seed).integers(0, x.size, (resamples, x.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def paired_difference(scores: dict, reference: dict) -> dict | None:
    """Mean of ``scores[s] - reference[s]`` over the samples both scored, with its bootstrap interval
    (``{"n", "mean", "ci95"}``), or None when they share no sample."""
    common = [s for s in scores if s in reference]
    if not common:
        return None
    diffs = [scores[s] - reference[s] for s in common]
    return {"n": len(common), "mean": float(np.mean(diffs)), "ci95": bootstrap_ci(diffs)}
