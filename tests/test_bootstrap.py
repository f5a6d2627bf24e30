"""The bootstrap intervals against analytic behaviour and independent numpy derivations made from the same draws;
Spearman's rho against hand rankings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsieve.bootstrap import (
    BLOCK,
    bootstrap_interval,
    bootstrap_ratio_interval,
    spearman,
    spearman_interval,
    two_level_interval,
)

# -- of a mean over requests, of a paired % of full ------------------------------------------------------------


def test_constant_data_gives_a_zero_width_interval():
    low, high = bootstrap_interval([42.5] * 37)
    assert low == high == pytest.approx(42.5)


def test_large_bernoulli_sample_matches_the_normal_approximation():
    n, p = 2000, 0.3
    x = np.zeros(n)
    x[: int(n * p)] = 1.0
    low, high = bootstrap_interval(x, seed=3)
    half = 1.96 * math.sqrt(p * (1 - p) / n)  # 0.0201
    assert low == pytest.approx(p - half, abs=0.002)
    assert high == pytest.approx(p + half, abs=0.002)


def test_interval_equals_an_independent_derivation_with_the_same_seed():
    # same draws (documented: default_rng(seed).integers(0, n, (b, n)) in blocks of BLOCK), means from
    # counts and the quantile by hand (linear interpolation between order statistics)
    x = np.array([0, 100, 100, 50, 0, 100, 25, 100, 0, 75, 100, 100, 0], dtype=float)
    resamples, seed = 2500, 11
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, resamples, BLOCK):
        for row in rng.integers(0, x.size, size=(min(BLOCK, resamples - start), x.size)):
            means.append(float(np.bincount(row, minlength=x.size) @ x) / x.size)
    ordered = sorted(means)

    def quantile(q: float) -> float:
        h = (len(ordered) - 1) * q
        i = math.floor(h)
        return ordered[i] + (h - i) * (ordered[min(i + 1, len(ordered) - 1)] - ordered[i])

    low, high = bootstrap_interval(x, resamples=resamples, seed=seed)
    assert low == pytest.approx(quantile(0.025), abs=1e-9)
    assert high == pytest.approx(quantile(0.975), abs=1e-9)
    assert bootstrap_interval(x, resamples=resamples, seed=seed) == (low, high)  # seeded: repeatable
    assert low < x.mean() < high


def test_interval_is_shift_equivariant_and_narrows_with_n():
    x = np.array([0.0, 100.0, 100.0, 0.0, 100.0, 50.0])
    low, high = bootstrap_interval(x, seed=5)
    shifted = bootstrap_interval(x + 7.0, seed=5)
    assert shifted == pytest.approx((low + 7.0, high + 7.0))
    wide = bootstrap_interval(np.tile([0.0, 100.0], 8))
    narrow = bootstrap_interval(np.tile([0.0, 100.0], 200))
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 3  # width ~ 1/sqrt(n): 400/16 = 25 -> 5x


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_interval([])
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval([1.0], resamples=0)
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval([1.0], level=95)


def test_ratio_interval_matches_the_delta_method_and_pairs_the_requests():
    """% of full's interval against an independent derivation: the delta-method normal interval of a ratio of
    paired means, 100 (mx/my) +- 1.96 sqrt(var(x - R y) / n) / my, which the bootstrap approaches for large n."""
    rng = np.random.default_rng(3)
    n = 600
    full = rng.choice([0.0, 100.0], size=n, p=[0.2, 0.8])
    policy = np.where(rng.random(n) < 0.75, full, 0.0)  # loses a quarter of what full gets, per request
    ratio = policy.mean() / full.mean()
    se = np.sqrt(np.var(policy - ratio * full) / n) / full.mean()
    low, high = bootstrap_ratio_interval(policy, full, resamples=4000, seed=1)
    assert low == pytest.approx(100 * (ratio - 1.96 * se), abs=0.6)
    assert high == pytest.approx(100 * (ratio + 1.96 * se), abs=0.6)
    # pairing: the unpaired interval (policy and full resampled apart) is wider when the two move together
    unpaired = np.sqrt(np.var(policy) / n + ratio**2 * np.var(full) / n) / full.mean()
    assert high - low < 0.8 * 2 * 1.96 * 100 * unpaired
    assert bootstrap_ratio_interval(0.5 * full, full, seed=2) == pytest.approx((50.0, 50.0))
    assert all(math.isnan(v) for v in bootstrap_ratio_interval([1.0, 2.0], [0.0, 0.0]))
    with pytest.raises(ValueError, match="one length"):
        bootstrap_ratio_interval([1.0, 2.0], [1.0])


# -- over seeds and requests ------------------------------------------------------------------------------------


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


# -- Spearman's rho over programs --------------------------------------------------------------------------------


def test_spearman_matches_hand_rankings_with_and_without_ties():
    # ranks of x: 1 2 3 4; of y: 2 1 4 3 -> d^2 sums to 4 -> rho = 1 - 6 * 4 / (4 * 15) = 0.6
    assert spearman([1, 2, 3, 4], [20, 10, 40, 30]) == pytest.approx(0.6)
    # y ties its first two: ranks 1.5 1.5 3 4; Pearson of (1 2 3 4) and (1.5 1.5 3 4) by hand:
    # centred (-1.5 -0.5 0.5 1.5) and (-1 -1 0.5 1.5): dot 4.5, squared norms 5 and 4.5
    assert spearman([1, 2, 3, 4], [7, 7, 8, 9]) == pytest.approx(4.5 / math.sqrt(5 * 4.5))
    assert spearman([3, 1, 2], [30, 10, 20]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_spearman_interval_resamples_the_pairs():
    """The interval from the same draws made with plain numpy; a perfectly monotone relation stays at 1."""
    x = np.array([0.1, 0.4, 0.2, 0.9, 0.5, 0.7, 0.3, 0.8])
    y = np.array([1.0, 2.0, 4.0, 7.0, 3.0, 8.0, 0.5, 6.0])
    rho, low, high = spearman_interval(x, y, resamples=500, seed=4)
    draws = [spearman(x[i], y[i]) for i in np.random.default_rng(4).integers(0, 8, (500, 8))]
    assert rho == pytest.approx(spearman(x, y))
    assert (low, high) == pytest.approx(tuple(np.nanquantile(draws, [0.025, 0.975])))
    assert low <= rho <= high
    assert spearman_interval(x, 3 * x + 1, resamples=200) == pytest.approx((1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="one length"):
        spearman_interval([1.0, 2.0], [1.0])
