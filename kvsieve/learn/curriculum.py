"""The budget curriculum: compression ramps up over training (DMS ramps compression 1x to 8x; DistillCache's
budgets are fixed), so the policy first learns where a mild budget errs before the hard budgets weigh in.

``active_ratios(ratios, step, steps)``: at ``step`` the compression ratios up to
``low + (high - low) * step / steps`` are active (``low``/``high`` the smallest and largest of ``ratios``);
from ``step >= steps`` every ratio is. ``steps = 0`` switches the curriculum off. The ramp is a function of the
step number alone, so a resumed run follows it exactly.
"""

from __future__ import annotations

__all__ = ["active_ratios"]


def active_ratios(ratios: list[float], step: int, steps: int) -> list[float]:
    """The ratios of ``ratios`` (order kept) a step of the curriculum trains on; never empty."""
    if not ratios:
        raise ValueError("the curriculum needs at least one compression ratio")
    if steps <= 0 or step >= steps:
        return list(ratios)
    low, high = min(ratios), max(ratios)
    reach = low + (high - low) * step / steps
    return [r for r in ratios if r <= reach + 1e-12]
