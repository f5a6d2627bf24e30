"""Percentile-bootstrap intervals over requests: of a mean, of a paired ratio of means.

Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13: ``resamples`` means of ``n`` values drawn
with replacement, their ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. Seeded, and the same seed for every
cell of a table: cells with the same requests draw the same resample indices, so their intervals compare directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["BLOCK", "DEFAULT_RESAMPLES", "DEFAULT_SEED", "LEVEL", "bootstrap_interval", "bootstrap_ratio_interval"]

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
