"""Percentile-bootstrap intervals: of a mean over requests, of a paired ratio of means, of a mean over seeds and
requests together, of Spearman's rank correlation over programs.

Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13: ``resamples`` statistics of values drawn
with replacement, their ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. Seeded, and the same seed for every
cell of a table: cells with the same requests draw the same resample indices, so their intervals compare directly.
The headline's tables (:mod:`kvsieve.harness.headline_tables`), the evolution study and the selection rule's seed
margin (:mod:`kvsieve.evolve`) all draw here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["BLOCK", "DEFAULT_RESAMPLES", "DEFAULT_SEED", "LEVEL", "bootstrap_interval", "bootstrap_ratio_interval",
           "spearman", "spearman_interval", "two_level_interval"]

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
LEVEL = 0.95
BLOCK = 1000  # resamples drawn per call to the generator, so memory stays at BLOCK x n indices


def _check_resampling(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _resample_blocks(n: int, resamples: int, seed: int) -> Iterator[np.ndarray]:
    """The resampled request indices, ``integers(0, n, (b, n))`` of ``default_rng(seed)`` in blocks of at most
    ``BLOCK`` resamples (memory stays at ``BLOCK x n`` indices)."""
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, BLOCK):
        yield rng.integers(0, n, size=(min(BLOCK, resamples - start), n))


def _percentile_interval(statistics: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(statistics, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_interval(values: Sequence[float] | np.ndarray, resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` at confidence ``level``.

    The resample indices come from ``np.random.default_rng(seed)``, drawn as ``integers(0, n, (b, n))``
    in blocks of at most ``BLOCK`` resamples; the bounds are ``np.quantile`` (linear interpolation) of
    the ``resamples`` means at ``(1 - level) / 2`` and ``(1 + level) / 2``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-d list of values, got shape {x.shape}")
    _check_resampling(resamples, level)
    means = np.concatenate([x[idx].mean(axis=1) for idx in _resample_blocks(x.size, resamples, seed)])
    return _percentile_interval(means, level)


def bootstrap_ratio_interval(numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray,
                             resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                             level: float = LEVEL) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of ``100 * mean(numerator) / mean(denominator)`` (e.g. a policy's
    % of full): the same resampled requests in both, drawn as in :func:`bootstrap_interval`; resamples whose
    denominator mean is 0 are left out (all of them: ``(nan, nan)``)."""
    num, den = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if num.ndim != 1 or num.size == 0 or num.shape != den.shape:
        raise ValueError(f"a paired bootstrap needs two non-empty 1-d lists of one length, got shapes {num.shape} "
                         f"and {den.shape}")
    _check_resampling(resamples, level)
    ratios = []
    for idx in _resample_blocks(num.size, resamples, seed):
        top, bottom = num[idx].mean(axis=1), den[idx].mean(axis=1)
        ratios.append(100.0 * top[bottom > 0] / bottom[bottom > 0])
    ratios = np.concatenate(ratios)
    return _percentile_interval(ratios, level) if ratios.size else (math.nan, math.nan)


def two_level_interval(values: np.ndarray | list[list[float]], resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_SEED, level: float = LEVEL) -> tuple[float, float, float]:
    """Mean of a (seeds, requests) array and its percentile-bootstrap interval, resampling the seeds (rows) and,
    independently, the requests (columns, the same draw for every row: the requests are shared), each with
    replacement: the interval covers both the run-to-run and the request-to-request variation. The draws are
    ``default_rng(seed).integers(0, seeds, (resamples, seeds))`` then ``integers(0, requests, (resamples,
    requests))``."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"two_level_interval needs a non-empty (seeds, requests) array, got shape {x.shape}")
    _check_resampling(resamples, level)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, x.shape[0], (resamples, x.shape[0]))
    cols = rng.integers(0, x.shape[1], (resamples, x.shape[1]))
    means = np.array([x[np.ix_(r, c)].mean() for r, c in zip(rows, cols)])
    return (float(x.mean()), *_percentile_interval(means, level))


def _average_ranks(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of their ranks."""
    v = np.asarray(values, dtype=np.float64)
    ranks = np.empty(v.size)
    ranks[np.argsort(v, kind="stable")] = np.arange(1, v.size + 1)
    _, group = np.unique(v, return_inverse=True)
    return (np.bincount(group, weights=ranks) / np.bincount(group))[group]


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties): Pearson's correlation of the ranks; nan when either
    side is constant."""
    rx, ry = _average_ranks(x), _average_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def spearman_interval(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, resamples: int = 2000,
                      seed: int = DEFAULT_SEED, level: float = LEVEL) -> tuple[float, float, float]:
    """Spearman's rho and its percentile-bootstrap interval over the pairs (programs) resampled together; resamples
    whose rho is undefined (one side constant) are left out."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 1 or x.size < 2 or x.shape != y.shape:
        raise ValueError(f"spearman_interval needs two 1-d lists of one length >= 2, got shapes {x.shape} and "
                         f"{y.shape}")
    _check_resampling(resamples, level)
    rng = np.random.default_rng(seed)
    draws = [spearman(x[i], y[i]) for i in rng.integers(0, len(x), (resamples, len(x)))]
    low, high = np.nanquantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return spearman(x, y), float(low), float(high)
