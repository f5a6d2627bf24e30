"""Learn-then-Test certification of a KV retention operating point (Risk-Controlled KV-Cache Eviction).

Given a contract (target risk alpha, confidence 1 - delta, tolerance epsilon) and per-request losses
from calibration data, every candidate (policy, ratio) is a hypothesis "its risk exceeds alpha". The
candidates whose hypothesis is rejected under family-wise error control at delta are *certified*:
with probability at least 1 - delta over the calibration draw, all of them have risk <= alpha. The
operating point is the certified candidate that keeps the least cache; if none is certified, full KV.

"Kept" is one quantity everywhere (the table, the verdict, the choice): the mean fraction of the cache's
bytes a candidate keeps on the calibration requests (``LossTable.kept_fraction``), which includes the
sinks, window and question kept on top of the ratio's budget, so it is above ``1 - ratio``.
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, field, replace

import numpy as np

from kvsieve.policies.label import Point
from kvsieve.risk.losses import LOSSES, UTILITY_SCALE, LossTable
from kvsieve.risk.pvalues import binomial_pvalue, hoeffding_bentkus_pvalue, min_calibration_size
from kvsieve.risk.testing import CORRECTIONS, chains_rejected, fixed_sequence

__all__ = ["Contract", "CandidateResult", "Certification", "InsufficientCalibrationError", "certify",
           "empirical_threshold", "p_value"]


class InsufficientCalibrationError(ValueError):
    """Too few calibration requests for any candidate to be certified under the contract."""


@dataclass(frozen=True)
class Contract:
    """A deployment's reliability requirement: P(risk <= alpha) >= 1 - delta, degradation beyond epsilon points."""

    alpha: float = 0.1
    delta: float = 0.1
    epsilon: float = 0.0
    loss: str = "binary"
    correction: str = "bonferroni"
    split_fraction: float = 0.5  # correction="split": share of the calibration data that orders the candidates

    def __post_init__(self) -> None:
        for name in ("alpha", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        epsilon = self.epsilon
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < UTILITY_SCALE:
            # a drop of 100 points or more cannot happen on the 0-100 scale: every candidate would certify
            raise ValueError(f"epsilon must be in [0, {UTILITY_SCALE:g}) (a tolerated utility drop in metric points "
                             f"on the 0-{UTILITY_SCALE:g} scale), got {epsilon!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction {self.correction!r} is not one of {', '.join(CORRECTIONS)}")
        if not 0 < self.split_fraction < 1:
            raise ValueError(f"split_fraction must be in (0, 1), got {self.split_fraction!r}")

    def min_requests(self, compressors: int = 1) -> int:
        """Fewest calibration requests that can certify anything (zero failures) among ``compressors``.

        Bonferroni and Holm test each compressor's first candidate at delta / m, so zero failures
        need n >= log(delta / m) / log(1 - alpha); the split fixed sequence tests at the full delta.
        """
        level = self.delta if self.correction == "split" else self.delta / max(compressors, 1)
        return min_calibration_size(self.alpha, level)


@dataclass
class CandidateResult:
    policy: str
    ratio: float
    question_aware: bool
    empirical_risk: float
    p_value: float
    certified: bool
    kept_fraction: float  # mean cache bytes kept / full
    setting: str = ""  # Point.setting: query-agnostic / question-aware prefill, or decode-time eviction
    point: InitVar[Point | None] = None  # the candidate, given by certify; not a field: a contract keeps the above

    def __post_init__(self, point: Point | None) -> None:
        # a contract read back gives the candidate's stored label: read once, here (the contract file's form)
        self._candidate = point if point is not None else Point.parse(self.policy, self.ratio, self.question_aware)
        self.setting = self.setting or self._candidate.setting  # contracts written before it: derived

    @property
    def candidate(self) -> Point:
        return self._candidate


@dataclass
class Certification:
    """The outcome of one certification: the contract, n, every candidate's figures and the choice."""

    alpha: float
    delta: float
    epsilon: float
    loss: str
    correction: str
    n: int
    candidates: list[CandidateResult] = field(default_factory=list)
    chosen: Point | None = None
    reason: str = ""  # why it fell back, when it did

    @property
    def fell_back(self) -> bool:
        return self.chosen is None

    @property
    def chosen_result(self) -> CandidateResult | None:
        """The chosen candidate's figures (``None``: full KV)."""
        return next((c for c in self.candidates if c.candidate == self.chosen), None)

    def table_lines(self) -> list[str]:
        """One line per candidate: label, setting, bytes kept, empirical risk, p-value, certified."""
        if not self.candidates:
            return []
        width = max(28, *(len(str(c.candidate)) for c in self.candidates))
        lines = [f"{'candidate':<{width}} {'kept bytes':>10} {'risk':>7} {'p-value':>9}  certified  setting"]
        for c in sorted(self.candidates, key=lambda c: (c.policy, c.question_aware, c.ratio)):
            lines.append(f"{str(c.candidate):<{width}} {c.kept_fraction:>10.3f} {c.empirical_risk:>7.3f} "
                         f"{c.p_value:>9.3g}  {'yes' if c.certified else 'no ':<9}  {c.setting}")
        return lines

    def verdict(self) -> str:
        """The choice in words, with the same "kept bytes" figure the table shows."""
        chosen = self.chosen_result
        if chosen is None:
            return f"full KV: {self.reason}"
        return (f"{chosen.candidate} ({chosen.setting}): keeps {chosen.kept_fraction:.3f} of the cache bytes "
                f"at compression ratio {chosen.ratio:g}")

    def to_dict(self) -> dict:
        out = asdict(replace(self, chosen=None))
        out["chosen"] = _record(self.chosen) if self.chosen else None
        out["fell_back"] = self.fell_back
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Certification:
        data = dict(data)
        data.pop("fell_back", None)
        try:
            data["candidates"] = [CandidateResult(**c) for c in data.get("candidates", [])]
        except ValueError as err:
            raise ValueError(f"candidate: {err}") from err
        chosen = data.get("chosen")
        try:
            data["chosen"] = (Point.parse(chosen["policy"], chosen["ratio"], chosen["question_aware"]) if chosen
                              else None)
        except ValueError as err:
            raise ValueError(f"chosen point: {err}") from err
        return cls(**data)


def _record(point: Point) -> dict:
    """A contract's form of a point, as contracts have always stored it: the stored label, ratio, question-aware."""
    return {"policy": point.stored, "ratio": point.ratio, "question_aware": point.question_aware}


def _compressor(point: Point) -> tuple[str, bool]:
    """Candidates of one compressor (one stored label, question-aware or not) form one fixed-sequence chain."""
    return point.stored, point.question_aware


def p_value(losses: np.ndarray, alpha: float, loss: str = "binary") -> float:
    """Exact binomial p-value for binary losses, Hoeffding-Bentkus for bounded ones."""
    n = len(losses)
    if loss == "binary":
        return binomial_pvalue(int(round(float(np.sum(losses)))), n, alpha)
    return hoeffding_bentkus_pvalue(float(np.mean(losses)), n, alpha)


def _least_cache(candidates: list[Point], table: LossTable) -> Point | None:
    """The candidate keeping the least cache (fewest bytes kept; then highest ratio; then lower risk)."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (table.kept_fraction.get(c, c.retention), -c.ratio,
                                          float(np.mean(table.losses[c])), str(c)))


def _chains(candidates: list[Point]) -> list[list[Point]]:
    """One chain per compressor, from most to least retention."""
    chains: dict[tuple, list[Point]] = {}
    for cand in candidates:
        chains.setdefault(_compressor(cand), []).append(cand)
    return [sorted(chain, key=lambda c: c.ratio) for _, chain in sorted(chains.items())]


def certify(table: LossTable, contract: Contract, seed: int = 0) -> Certification:
    """Certify the most aggressive candidate of ``table`` under ``contract``; full KV (``chosen=None``) if none.

    Raises InsufficientCalibrationError when ``table`` has fewer requests than any candidate would need
    (``contract.min_requests(compressors)``; with ``correction="split"``, in the part that tests).
    """
    if table.loss != contract.loss or table.epsilon != contract.epsilon:
        raise ValueError(f"the loss table was built with loss={table.loss!r}, epsilon={table.epsilon}; "
                         f"the contract asks for loss={contract.loss!r}, epsilon={contract.epsilon}")
    candidates = sorted(table.losses)
    if not candidates:
        raise ValueError("no candidates to certify")
    test_rows = np.arange(table.n)
    order: list[Point] | None = None
    if contract.correction == "split":
        rng = np.random.default_rng(seed)
        perm = rng.permutation(table.n)
        cut = int(round(contract.split_fraction * table.n))
        learn, test_rows = perm[:cut], perm[cut:]
        learned = {c: p_value(table.losses[c][learn], contract.alpha, contract.loss) if len(learn) else 1.0
                   for c in candidates}
        order = sorted(candidates, key=lambda c: (learned[c], c.ratio))
    n = len(test_rows)
    compressors = len({_compressor(c) for c in candidates})
    needed = contract.min_requests(compressors)
    if n < needed:
        where = " in the testing part of the split" if contract.correction == "split" else ""
        rule = "log(delta)/log(1-alpha)"
        if contract.correction != "split" and compressors > 1:
            rule = f"log(delta/{compressors})/log(1-alpha) with {compressors} compressors"
        raise InsufficientCalibrationError(
            f"{n} calibration requests{where} cannot certify anything at alpha={contract.alpha}, "
            f"delta={contract.delta}: even with zero failures it needs n >= {rule} = {needed}")
    risks = {c: float(np.mean(table.losses[c][test_rows])) for c in candidates}
    pvals = {c: p_value(table.losses[c][test_rows], contract.alpha, contract.loss) for c in candidates}
    if order is not None:
        certified = set(order[: fixed_sequence([pvals[c] for c in order], contract.delta)])
    else:
        chains = _chains(candidates)
        counts = chains_rejected([[pvals[c] for c in chain] for chain in chains], contract.delta, contract.correction)
        certified = {c for chain, k in zip(chains, counts) for c in chain[:k]}
    results = [CandidateResult(c.policy, c.ratio, c.question_aware, risks[c], pvals[c], c in certified,
                               table.kept_fraction.get(c, c.retention), c.setting, point=c) for c in candidates]
    chosen = _least_cache(sorted(certified), table)
    reason = "" if chosen else "no candidate certified: falling back to full KV"
    return Certification(contract.alpha, contract.delta, contract.epsilon, contract.loss, contract.correction, n,
                         results, chosen, reason)


def empirical_threshold(table: LossTable, alpha: float) -> Point | None:
    """The uncertified baseline: the least-cache candidate whose empirical risk is <= alpha (None: full KV)."""
    passing = [c for c, losses in table.losses.items() if float(np.mean(losses)) <= alpha]
    return _least_cache(passing, table)
