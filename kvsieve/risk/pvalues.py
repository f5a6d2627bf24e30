"""p-values for the null hypothesis "the risk of this candidate exceeds alpha".

A small p-value is evidence that the candidate's risk (the population mean of its loss) is at most
alpha. Two valid p-values, as in Learn-then-Test (Angelopoulos et al., 2021, arXiv 2110.01052):

* exact binomial, for binary losses: with k failures in n requests,
  p = P(Binomial(n, alpha) <= k);
* Hoeffding-Bentkus, for any loss bounded in [0, 1] with empirical mean r:
  p = min(exp(-n * h(min(r, alpha), alpha)), e * P(Binomial(n, alpha) <= ceil(n * r))),
  where h(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)).

On binary losses Hoeffding-Bentkus is never smaller than the exact binomial p-value (both of its
terms upper-bound the same binomial tail), so it certifies less.
"""

from __future__ import annotations

import math

__all__ = ["binomial_cdf", "binomial_pvalue", "hoeffding_bentkus_pvalue", "clopper_pearson",
           "min_calibration_size"]


def _check_probability(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space so n in the thousands is exact to rounding."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
                 for i in range(k + 1)]
    top = max(log_terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in log_terms))


def binomial_pvalue(failures: int, n: int, alpha: float) -> float:
    """Exact p-value of H0: risk > alpha, from ``failures`` binary losses out of ``n``."""
    _check_probability("alpha", alpha)
    if not 0 <= failures <= n:
        raise ValueError(f"failures must be in [0, n={n}], got {failures}")
    return binomial_cdf(failures, n, alpha)


def _kl_bernoulli(a: float, b: float) -> float:
    """h(a, b): the KL divergence between Bernoulli(a) and Bernoulli(b)."""
    first = 0.0 if a == 0 else a * math.log(a / b)
    second = 0.0 if a == 1 else (1 - a) * math.log((1 - a) / (1 - b))
    return first + second


def hoeffding_bentkus_pvalue(mean_loss: float, n: int, alpha: float) -> float:
    """p-value of H0: risk > alpha for a loss bounded in [0, 1] with empirical mean ``mean_loss`` over n."""
    _check_probability("alpha", alpha)
    if not 0.0 <= mean_loss <= 1.0:
        raise ValueError(f"mean_loss must be in [0, 1], got {mean_loss!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    hoeffding = math.exp(-n * _kl_bernoulli(min(mean_loss, alpha), alpha))
    # ceil of n * r, guarded against float noise (0.3 * 10 = 3.0000000000000004)
    k = math.ceil(round(n * mean_loss, 9))
    bentkus = math.e * binomial_cdf(k, n, alpha)
    return min(1.0, hoeffding, bentkus)


def clopper_pearson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided confidence interval for a binomial proportion (bisection on the binomial tail)."""
    _check_probability("confidence", confidence)
    if not 0 <= successes <= n or n < 1:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes} of {n}")
    tail = (1 - confidence) / 2

    def solve(k: int, target: float) -> float:
        """The p at which P(Binomial(n, p) <= k) = target; that tail decreases in p."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if binomial_cdf(k, n, mid) > target else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if successes == 0 else solve(successes - 1, 1 - tail)
    upper = 1.0 if successes == n else solve(successes, tail)
    return lower, upper


def min_calibration_size(alpha: float, delta: float) -> int:
    """Fewest requests that can certify anything: with zero failures, n >= log(delta) / log(1 - alpha)."""
    _check_probability("alpha", alpha)
    _check_probability("delta", delta)
    return math.ceil(math.log(delta) / math.log(1 - alpha) - 1e-12)
