"""The bootstrap over seeds and requests, against the same draws made with plain numpy."""

import numpy as np
import pytest

from kvsieve.evolve.intervals import two_level_interval


def test_two_level_interval_covers_seeds_and_requests():
    """x[s, r] = a_s + b_r: every resampled mean is mean(a[rows]) + mean(b[cols]) (derived with plain numpy from
    the same draws); a constant array has a point interval."""
    a, b = np.array([0.0, 3.0, 9.0]), np.linspace(-5, 5, 40)
    x = a[:, None] + b[None, :]
    mean, low, high = two_level_interval(x, resamples=4000, seed=7)
    rng = np.random.default_rng(7)
    rows, cols = rng.integers(0, 3, (4000, 3)), rng.integers(0, 40, (4000, 40))
    means = a[rows].mean(axis=1) + b[cols].mean(axis=1)
    assert mean == pytest.approx(x.mean())
    assert (low, high) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    assert two_level_interval(np.full((3, 5), 2.5)) == pytest.approx((2.5, 2.5, 2.5))
    with pytest.raises(ValueError, match="seeds, requests"):
        two_level_interval(np.zeros(4))
