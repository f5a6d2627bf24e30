"""How a question recalls evicted entries (the two-tier cache's setting): a point's ``recall``, parsed once.

The engine's side (the cold tier, the sketches, recall inside each layer) is ``engine/tiers.py``; this is the
setting a point, a results row and a contract carry, and the budget arithmetic that keeps the recalled entries and
the hot sketches inside the point's bytes. Text form: ``recall(fraction=0.025, chunk=16)`` (defaults left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsieve.spec import parse_spec

__all__ = ["COLD_FORMATS", "HEADS", "POOLS", "SKETCHES", "Recall"]

POOLS = ("chunk", "span")  # how entries share a best score: aligned chunks, or a span after each entry
HEADS = ("own", "shared")  # each KV head ranks by its own scores, or a layer's heads by their best at a position

SKETCHES = ("exact", "sign", "lowrank")  # how cold entries are scored: their own keys, or a sketch kept hot
COLD_FORMATS = ("exact", "int8", "int4", "disk")  # how the cold tier holds them (engine/cold.py)


@dataclass(frozen=True)
class Recall:
    """How a question recalls: ``fraction`` of the context's entries per KV head brought back, scored ``sketch``
    (``exact`` on the cold keys, ``sign`` or ``lowrank`` on a sketch kept hot, of ``rank`` dims), ranked by
    ``pool``: aligned chunks of ``chunk`` positions by their best entry (``chunk``), or each entry by the best entry
    from ``chunk`` positions before it to ``chunk // 4`` after (``span``: the value that follows the key a question
    names comes back with it); the evicted entries kept in the ``cold`` format."""

    fraction: float
    sketch: str = "exact"
    chunk: int = 16
    pool: str = "chunk"
    heads: str = "own"
    cold: str = "exact"
    rank: int = 8

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 <= f < 1:
            raise ValueError(f"recall fraction {f!r} is not in [0, 1): it is the share of the context recalled")
        if self.pool not in POOLS:
            raise ValueError(f"recall pool {self.pool!r} is not one of {', '.join(POOLS)}")
        if self.heads not in HEADS:
            raise ValueError(f"recall heads {self.heads!r} is not one of {', '.join(HEADS)}")
        if self.sketch not in SKETCHES:
            raise ValueError(f"recall sketch {self.sketch!r} is not one of {', '.join(SKETCHES)}")
        if self.cold not in COLD_FORMATS:
            raise ValueError(f"cold format {self.cold!r} is not one of {', '.join(COLD_FORMATS)}")
        for name in ("chunk", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"recall {name} must be a positive int, got {value!r}")

    def sketch_share(self, head_dim: int, itemsize: int) -> float:
        """Bytes a cold entry's sketch keeps hot, as a share of the entry's full key and value."""
        full = 2 * head_dim * itemsize
        if self.sketch == "sign":
            return (head_dim / 8 + 2) / full  # the signs packed, one float16 scale
        if self.sketch == "lowrank":
            return 2 * self.rank / full  # rank float16 coefficients (the basis, per head, is not counted per entry)
        return 0.0

    def policy_ratio(self, ratio: float, head_dim: int, itemsize: int) -> float:
        """The ratio the policy runs at so that what it keeps, the recalled entries and the sketches of the evicted
        ones fit a point keeping ``1 - ratio``: kept = (1 - ratio - fraction - s) / (1 - s), s the sketch share."""
        kept = 1.0 - ratio
        if not 0 <= self.fraction < kept:
            raise ValueError(f"recall fraction {self.fraction!r} is outside [0, {kept:g}): it must be below the share "
                             f"the point at ratio {ratio:g} keeps")
        s = self.sketch_share(head_dim, itemsize)
        policy_kept = (kept - self.fraction - s) / (1 - s)
        if policy_kept <= 0:
            raise ValueError(f"recall fraction {self.fraction!r} with the {self.sketch} sketch ({100 * s:.1f}% of an "
                             f"entry) leaves the policy nothing of the {100 * kept:g}% the point keeps")
        return 1.0 - policy_kept

    @property
    def text(self) -> str:
        """The stored form, ``recall(fraction=F, ...)`` with every setting that is not the default."""
        defaults = Recall(0.0)
        extra = [f"{name}={getattr(self, name)!r}" for name in ("chunk", "pool", "heads", "sketch", "cold", "rank")
                 if getattr(self, name) != getattr(defaults, name)]
        return f"recall({', '.join([f'fraction={self.fraction:g}', *extra])})"

    @classmethod
    def parse_setting(cls, text: str | float) -> Recall:
        """A command line's or a model arg's recall: a fraction (``0.025``) or :attr:`text`."""
        try:
            fraction = float(text)
        except (TypeError, ValueError):
            return cls.parse(str(text))
        return cls(fraction)

    @classmethod
    def parse(cls, text: str) -> Recall:
        """Read :attr:`text` back (``recall(fraction=0.025, sketch='sign')``); ValueError naming what is wrong."""
        try:
            name, params = parse_spec(text)
        except ValueError as err:
            raise ValueError(f"bad recall {text!r}: {err}") from None
        if name != "recall":
            raise ValueError(f"bad recall {text!r}: it reads recall(fraction=F, chunk=N, pool=P, heads=H, sketch=S, "
                             "cold=C, rank=R)")
        unknown = set(params) - {"fraction", "chunk", "pool", "heads", "sketch", "cold", "rank"}
        if unknown or "fraction" not in params:
            raise ValueError(f"bad recall {text!r}: give fraction=, and only chunk, pool, heads, sketch, cold, rank "
                             "besides "
                             f"(unknown: {', '.join(sorted(unknown)) or 'none'})")
        return cls(**params)
