"""Percentile-bootstrap intervals of evolve's comparisons: over seeds and the dev or held-out requests they share.

The study pools seeds (rows) and requests (columns); ``kvsieve pick`` compares its pick with the best seed program
on the dev cells both scored (one row). The harness's own intervals (:mod:`kvsieve.harness.bootstrap`) sit beside
this package, not below it, so evolve keeps its own.
"""

from __future__ import annotations

import numpy as np

__all__ = ["two_level_interval"]


def two_level_interval(values: np.ndarray | list[list[float]], resamples: int = 10_000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float, float]:
    """Mean of a (seeds, requests) array and its percentile-bootstrap interval, resampling the seeds (rows) and,
    independently, the requests (columns, the same draw for every row: the requests are shared), each with
    replacement: the interval covers both the run-to-run and the request-to-request variation."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"two_level_interval needs a non-empty (seeds, requests) array, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, x.shape[0], (resamples, x.shape[0]))
    cols = rng.integers(0, x.shape[1], (resamples, x.shape[1]))
    means = np.array([x[np.ix_(r, c)].mean() for r, c in zip(rows, cols)])
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(low), float(high)
