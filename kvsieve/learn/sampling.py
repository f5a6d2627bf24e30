"""Stochastic keep sets with an exact log-probability: Plackett-Luce sampling via Gumbel-top-k.

A keep set of ``k`` entries out of ``n`` is drawn without replacement from the softmax of the keep
logits, one entry at a time: the Plackett-Luce model (Plackett 1975; Luce 1959). Its probability of
the ordered draw ``o_1, ..., o_k`` is

    p(o) = prod_i exp(l[o_i]) / (sum_{j not in o_1..o_{i-1}} exp(l[j])).

Adding independent Gumbel(0, 1) noise to the logits and taking the ``k`` largest, in decreasing order
of the perturbed logits, samples exactly that ordered draw (the Gumbel-top-k trick: Yellott 1977;
Kool, van Hoof and Welling, "Stochastic Beams and Where to Find Them", ICML 2019, arXiv:1903.06059,
Sec. 2). So the engine's ordinary top-k selection on perturbed scores *is* the sampler, and the
policy never needs a sampling loop.

The training objective uses the log-probability of the ordered draw. The reward depends only on the
set, and ``E[R grad log p(order)] = grad E[R]`` holds for any random variable whose distribution
the parameters define, so REINFORCE on the order is unbiased (it has a little more variance than the
set's log-probability, which needs a sum over the ``k!`` orders: :func:`log_prob_of_set_bruteforce`
computes it for tiny cases, to check :func:`log_prob_of_ordered` in the tests).
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["gumbel_noise", "gumbel_top_k", "log_prob_of_ordered", "log_prob_of_set_bruteforce",
           "first_choice_entropy"]

_FLOOR = -1e30  # exp(_FLOOR - anything finite) is exactly 0 in float32 and float64


def gumbel_noise(shape, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Standard Gumbel noise, ``-log(-log U)`` with ``U`` uniform in (0, 1), float32."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    u = u.clamp(min=torch.finfo(torch.float64).tiny, max=1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).float()


def gumbel_top_k(logits: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(..., k) indices drawn without replacement, in draw order (a Plackett-Luce sample)."""
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"k={k} must be in 1..{logits.shape[-1]}")
    perturbed = logits + gumbel_noise(logits.shape, generator, logits.device)
    return torch.topk(perturbed, k, dim=-1, sorted=True).indices


def log_prob_of_ordered(logits: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(...) Plackett-Luce log-probability of drawing ``order`` (..., k) from ``logits`` (..., n).

    Entries with logit ``-inf`` are never drawn (they must not appear in ``order``). The ``i``-th
    denominator is the mass left after ``i - 1`` draws, written as the never-drawn mass plus the mass of
    draws ``i..k`` (a reverse cumulative log-sum-exp), so no subtraction of large sums loses precision.
    """
    # -inf -> a finite floor: the same (zero) mass, without NaN gradients when nothing is left undrawn
    logits = logits.clamp_min(_FLOOR)
    chosen = logits.gather(-1, order)  # (..., k)
    drawn = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, True)
    never = torch.logsumexp(logits.masked_fill(drawn, _FLOOR), dim=-1, keepdim=True)  # (..., 1)
    rest = torch.logcumsumexp(chosen.flip(-1), dim=-1).flip(-1)  # log sum_{j >= i} exp(chosen_j)
    return (chosen - torch.logaddexp(rest, never)).sum(dim=-1)


def log_prob_of_set_bruteforce(logits: torch.Tensor, subset: list[int]) -> float:
    """Exact log-probability that a Plackett-Luce draw of ``len(subset)`` items is ``subset``, any order.

    Sums :func:`log_prob_of_ordered` over the ``k!`` orders: for tests on tiny cases only (k <= 8).
    """
    if len(subset) > 8:
        raise ValueError(f"brute force over {math.factorial(len(subset))} orders is too many; use k <= 8")
    orders = torch.tensor(list(itertools.permutations(subset)), dtype=torch.long)
    values = log_prob_of_ordered(logits.double().expand(len(orders), -1), orders)
    return float(torch.logsumexp(values, dim=0))


def first_choice_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(...) entropy of the Plackett-Luce first draw (the softmax of the logits; ``-inf`` entries excluded)."""
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    return -(p * log_p.masked_fill(p == 0, 0.0)).sum(dim=-1)
