"""Multiple testing over candidate operating points, controlling the family-wise error rate at delta.

Candidates of one compressor form a chain ordered from most to least retention; its risk grows
(roughly) along the chain, so a *fixed-sequence* test walks it at the full level and stops at the
first candidate it cannot certify. Across compressors the level is shared:

* ``bonferroni``: each of m chains is tested at delta / m;
* ``holm``: the same, but a chain whose candidates are all certified passes its share of delta on to
  the chains still testing (the graphical, sequentially rejective form of Holm's procedure; Bretz et
  al., 2009), so it never certifies less than Bonferroni;
* ``split``: one chain over every candidate, ordered by p-values computed on a separate part of the
  calibration data, tested at the full delta on the rest (Learn-then-Test's split fixed sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CORRECTIONS", "fixed_sequence", "chains_rejected"]

CORRECTIONS = ("bonferroni", "holm", "split")


def fixed_sequence(p_values: Sequence[float], level: float) -> int:
    """How many leading hypotheses are rejected: p-values are tested in order until one exceeds ``level``."""
    rejected = 0
    for p in p_values:
        if p > level:
            break
        rejected += 1
    return rejected


def chains_rejected(chains: Sequence[Sequence[float]], delta: float, correction: str = "bonferroni") -> list[int]:
    """For each chain of p-values (in testing order), how many leading hypotheses are rejected."""
    if correction not in ("bonferroni", "holm"):
        raise ValueError(f"correction {correction!r} applies to one chain per compressor; use 'bonferroni' or 'holm'")
    if not chains:
        return []
    weights = [1.0 / len(chains)] * len(chains)
    rejected = [fixed_sequence(chain, w * delta) for chain, w in zip(chains, weights)]
    if correction == "bonferroni":
        return rejected
    while True:
        done = [i for i, chain in enumerate(chains) if rejected[i] == len(chain) and weights[i] > 0]
        active = [i for i, chain in enumerate(chains) if rejected[i] < len(chain)]
        if not done or not active:
            return rejected
        freed = sum(weights[i] for i in done)
        for i in done:
            weights[i] = 0.0
        for i in active:
            weights[i] += freed / len(active)
            rejected[i] = fixed_sequence(chains[i], weights[i] * delta)
