"""OperatingPoint: a Point, its built policy, the bucket, the fallback. Its point is what runs, so the point alone
says whether anything is evicted and whether the question is kept on top of the budget."""

from __future__ import annotations

import pytest

from kvsieve.policies import get
from kvsieve.policies.label import FULL_CACHE, Mode, Point
from kvsieve.policies.operating_point import OperatingPoint
from kvsieve.policy import FullCache


def test_full_kv_is_the_full_point_and_policy():
    full = OperatingPoint.full("<=1000", "bucket '<=1000' was not calibrated")
    assert full.point == Point(FULL_CACHE) and isinstance(full.policy, FullCache)
    assert full.fell_back and not full.point.compresses and full.point.budget is None
    assert str(full) == "full KV (bucket <=1000: bucket '<=1000' was not calibrated)"
    chosen = OperatingPoint.full(fell_back=False)  # full KV as the choice, not a fallback
    assert not chosen.fell_back and chosen.bucket == "-"


def test_a_point_that_evicts_nothing_or_another_policy_is_refused():
    with pytest.raises(ValueError, match="evicts nothing at ratio 0: that is full KV"):
        OperatingPoint(Point("knorm", 0.0), get("knorm"))
    with pytest.raises(ValueError, match="one compresses, the other does not"):
        OperatingPoint(Point("knorm", 0.5), FullCache())
    with pytest.raises(ValueError, match="one compresses, the other does not"):
        OperatingPoint(Point(FULL_CACHE), get("knorm"))
    with pytest.raises(ValueError, match="fell back runs full KV"):
        OperatingPoint(Point("knorm", 0.5), get("knorm"), "all", True)
    with pytest.raises(ValueError, match="is a Point"):
        OperatingPoint("knorm", get("knorm"))


def test_the_question_is_protected_only_by_a_question_aware_point():
    """protected_tail: the question's tokens where the point protects it (question-aware, evicting), else 0."""
    aware = OperatingPoint(Point("knorm", 0.5, True), get("knorm"), "all")
    assert aware.protected_tail(7) == 7 and str(aware) == "knorm+qa@0.5 (bucket all)"
    assert OperatingPoint(Point("knorm", 0.5), get("knorm")).protected_tail(7) == 0
    assert OperatingPoint(Point("knorm", 0.5, mode=Mode(64)), get("knorm")).protected_tail(7) == 0
    assert OperatingPoint.full().protected_tail(7) == 0
    with pytest.raises(ValueError, match="question_tokens must be an int >= 0"):
        aware.protected_tail(-1)
