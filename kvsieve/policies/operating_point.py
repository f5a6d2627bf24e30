"""A point as a request runs it (:class:`OperatingPoint`): a :class:`~kvsieve.policies.label.Point`, the policy built
for it, the bucket that chose it, and whether it fell back to full KV and why.

The contract's runtime (``risk/runtime.py``: ``CertifiedPolicy.operating_point``) makes one per request and the
server (``serve/``) runs them, so it lives below both. Everything about the setting (spec, ratio,
question-awareness, mode, whether it compresses, whether it protects the question, its budget) is the point's: read
``operating_point.point``; nothing here describes the setting a second time. Its point is what runs: full KV
(``Point(FULL_CACHE)``, the :class:`~kvsieve.policy.FullCache` policy) when it fell back, so ``point.compresses`` is
whether anything is evicted, and a compressing point at ratio 0, which evicts nothing, is refused (give
:meth:`OperatingPoint.full`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.policies.label import FULL_CACHE, Point
from kvsieve.policy import FullCache, Policy

__all__ = ["OperatingPoint"]


@dataclass(frozen=True)
class OperatingPoint:
    """What one request runs: ``point`` by ``policy`` (built and model-checked once, shared by every request of the
    point), chosen by ``bucket``; ``fell_back`` (with its ``reason``): full KV where a point was wanted."""

    point: Point
    policy: Policy
    bucket: str = "-"
    fell_back: bool = False
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.point, Point):
            raise ValueError(f"an operating point's point is a Point, got {type(self.point).__name__} {self.point!r}")
        if not isinstance(self.policy, Policy):
            raise ValueError(f"an operating point's policy is a built Policy, got {type(self.policy).__name__}")
        if self.policy.evicts != self.point.compresses:
            raise ValueError(f"policy {self.policy.name!r} does not run point {self.point}: one compresses, the other "
                             "does not")
        if self.point.compresses and self.point.budget is None:
            raise ValueError(f"point {self.point} evicts nothing at ratio 0: that is full KV (OperatingPoint.full)")
        if self.fell_back and not self.point.is_full:
            raise ValueError(f"an operating point that fell back runs full KV, not {self.point}")

    @classmethod
    def full(cls, bucket: str = "-", reason: str = "", fell_back: bool = True) -> OperatingPoint:
        """Full KV: by default a fall-back (``fell_back=False``: full KV is what was chosen)."""
        return cls(Point(FULL_CACHE), FullCache(), bucket, fell_back, reason)

    def protected_tail(self, question_tokens: int) -> int:
        """Tokens kept on top of the budget: the question's, when the point protects it."""
        if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 0:
            raise ValueError(f"question_tokens must be an int >= 0, got {question_tokens!r}")
        return question_tokens if self.point.protects_question else 0

    def __str__(self) -> str:
        if not self.point.compresses:
            return f"full KV (bucket {self.bucket}{': ' + self.reason if self.reason else ''})"
        return f"{self.point} (bucket {self.bucket})"
