"""Validity check by resampling: certify on a random calibration split, measure risk on the rest.

Repeated over many splits, the fraction of splits whose chosen operating point has test risk above
alpha estimates how often the guarantee is violated; certification should keep it at or below delta
(up to test-split noise), while empirical thresholding typically does not. Test splits are finite, so
a point whose true risk is just under alpha still shows test risk above alpha in some splits; the
violation rate is therefore also given against the *pooled* risk (all requests of the table, the
best estimate of the population risk available).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvsieve.policies.label import Point
from kvsieve.risk.certify import Contract, certify, empirical_threshold
from kvsieve.risk.losses import LossTable
from kvsieve.risk.pvalues import clopper_pearson

__all__ = ["MethodSummary", "ValidityResult", "split_validity"]


@dataclass
class MethodSummary:
    """How one selection method fared over the splits."""

    violations: int  # splits whose chosen point has test-split risk > alpha
    pooled_violations: int  # splits whose chosen point has pooled risk > alpha
    splits: int
    fallbacks: int
    mean_retention: float  # retained fraction of the chosen point, 1.0 for full KV
    mean_test_risk: float
    choices: dict[str, int]  # operating point -> how often chosen

    @property
    def violation_rate(self) -> float:
        return self.violations / self.splits

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        return clopper_pearson(self.violations, self.splits, confidence)


@dataclass
class ValidityResult:
    contract: Contract
    n_calibration: int
    n_test: int
    certified: MethodSummary
    empirical: MethodSummary


def _summarise(choices: list[Point | None], test_risks: list[float], pooled: dict[Point, float],
               alpha: float) -> MethodSummary:
    counts: dict[str, int] = {}
    for c in choices:
        name = str(c) if c else "full KV"
        counts[name] = counts.get(name, 0) + 1
    pooled_violations = sum(c is not None and pooled[c] > alpha for c in choices)
    return MethodSummary(sum(r > alpha for r in test_risks), pooled_violations, len(choices),
                         sum(c is None for c in choices),
                         float(np.mean([c.retention if c else 1.0 for c in choices])), float(np.mean(test_risks)),
                         dict(sorted(counts.items(), key=lambda kv: -kv[1])))


def split_validity(table: LossTable, contract: Contract, splits: int = 500, calibration_fraction: float = 0.5,
                   seed: int = 0, progress: Callable[[int], None] | None = None) -> ValidityResult:
    """Certify and threshold on ``splits`` random calibration/test splits of ``table``'s requests."""
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if not 0 < calibration_fraction < 1:
        raise ValueError(f"calibration_fraction must be in (0, 1), got {calibration_fraction}")
    rng = np.random.default_rng(seed)
    n_cal = int(round(calibration_fraction * table.n))
    if n_cal < 1 or n_cal >= table.n:
        raise ValueError(f"{table.n} requests cannot be split {calibration_fraction:.2f} / rest")
    cert_choices, cert_risks, emp_choices, emp_risks = [], [], [], []
    for i in range(splits):
        perm = rng.permutation(table.n)
        cal, test = table.subset(perm[:n_cal]), table.subset(perm[n_cal:])
        chosen = certify(cal, contract, seed=int(rng.integers(1 << 31))).chosen
        baseline = empirical_threshold(cal, contract.alpha)
        for choice, choices, risks in ((chosen, cert_choices, cert_risks), (baseline, emp_choices, emp_risks)):
            choices.append(choice)
            risks.append(0.0 if choice is None else float(np.mean(test.losses[choice])))
        if progress:
            progress(i + 1)
    pooled = {c: float(np.mean(losses)) for c, losses in table.losses.items()}
    return ValidityResult(contract, n_cal, table.n - n_cal,
                          _summarise(cert_choices, cert_risks, pooled, contract.alpha),
                          _summarise(emp_choices, emp_risks, pooled, contract.alpha))
