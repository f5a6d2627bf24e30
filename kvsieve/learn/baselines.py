"""Variance control for REINFORCE: the leave-one-out baseline over K rollouts of one (request, budget).

With ``K`` rollouts of the same request and budget, rollout ``k``'s baseline is the mean return of the *other*
``K - 1`` (Kool, van Hoof and Welling, "Buy 4 REINFORCE samples, get a baseline for free!", ICLR 2019 workshop;
Apple's KVP uses it for eviction). It does not depend on rollout ``k``'s own actions, so the estimator stays
unbiased, and it needs no extra (greedy) rollout. Written out: ``b_k = (sum_j G_j - G_k) / (K - 1)``, so the
advantages ``G_k - b_k = K / (K - 1) * (G_k - mean_j G_j)`` sum to zero.
"""

from __future__ import annotations

__all__ = ["leave_one_out"]


def leave_one_out(returns: list[dict[int, float]]) -> list[dict[int, float]]:
    """Per rollout, per decision time ``t``: the mean return at ``t`` of the other rollouts that decided at ``t``.

    A time only one rollout reached gets a baseline of 0 (nothing to compare it with)."""
    if len(returns) < 2:
        raise ValueError(f"a leave-one-out baseline needs at least 2 rollouts, got {len(returns)}")
    totals: dict[int, float] = {}
    counts: dict[int, int] = {}
    for r in returns:
        for t, g in r.items():
            totals[t] = totals.get(t, 0.0) + g
            counts[t] = counts.get(t, 0) + 1
    return [{t: (totals[t] - g) / (counts[t] - 1) if counts[t] > 1 else 0.0 for t, g in r.items()} for r in returns]
