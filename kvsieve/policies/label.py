"""A policy run at a setting (:class:`Point`), and the label a results row is keyed by.

A point is a policy spec, a compression ratio, whether the question was kept out of compression, and the mode
(:class:`Mode`: prefill compression, or decode-time eviction with its chunk and eviction interval). It is the one
type of a grid cell's setting (``harness/grid.py``), a certification candidate (``risk/losses.py``) and a row's label,
and everything derived from it is derived here, once: its stored and display text, whether its family
``compresses``, whether it ``protects_question``, its full-KV ``reference``, its ``budget``. The ratio is checked
here, once (``selection.Budget`` checks its own), and so are the spec's syntax and the mode's pairing with
question-awareness (a decode-time point reads the question under eviction, so none is question-aware).

Stored form (the store's ``policy`` column): ``SPEC`` for prefill compression, ``SPEC@decodeN`` for
decode-time eviction (the context read in chunks of N tokens), ``SPEC@decodeNeE`` when generated tokens are
evicted every E > 1 of them. Display form (tables, plots, comparisons): the stored form with ``+qa`` appended
for a question-aware row (the question kept out of compression; the store keeps that in its own column).

:meth:`Point.parse` and :attr:`Point.stored` / :attr:`Point.display` are the one parser and formatter of both forms:
nothing else in kvsieve splits or builds a label. A label is read as text only where text comes in: a user's flag
(``--policies``, ``--compare``), a contract file, and the migration of a results store written before the store kept
each row's point in structured form (``harness/store.py``); reports take the points the store hands back. The stored
text forms are unchanged, so every store, contract and config written before still reads. Reading a point opens no file:
a store holds labels of program files and checkpoints that may no longer exist, and its tables must still be drawn. A
family that is no longer registered (rows of an older kvsieve) reads as an ordinary compressing policy, not a reference.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvsieve.policies.registry import PolicySpec, family_class, parse
from kvsieve.policy import FullCache, Policy
from kvsieve.recall import Recall
from kvsieve.selection import Budget
from kvsieve.spec import parse_spec

__all__ = ["DECODE", "FULL_CACHE", "MODES", "PREFILL", "QA_SUFFIX", "Mode", "Point", "display_order"]

FULL_CACHE: str = FullCache.name  # the full cache's spec and stored label (prefill); the reference of every row
PREFILL, DECODE = "prefill", "decode"
MODES = (PREFILL, DECODE)
QA_SUFFIX = "+qa"  # display only: the store records question-awareness in its own column

_DECODE_SUFFIX = re.compile(r"@decode(?P<chunk>[1-9][0-9]*)(?:e(?P<every>[1-9][0-9]*))?$")
_ANY_DECODE_SUFFIX = re.compile(r"@decode[^()]*$")  # what a decode suffix looks like, well formed or not
_RECALL_SUFFIX = re.compile(r"@(?P<recall>recall\([^()]*\))$")


@lru_cache(maxsize=4096)
def _family_of(spec: str) -> str:
    """The family name a spec calls (text only: ``program:PATH`` opens nothing)."""
    return parse_spec(spec)[0]


@dataclass(frozen=True)
class Mode:
    """How the cache is held under the budget: prefill compression (``chunk_size`` 0, compress once after the
    context), or decode-time eviction reading the context in chunks of ``chunk_size`` tokens and evicting every
    ``evict_every`` generated tokens. Its :attr:`name` is :data:`PREFILL` or :data:`DECODE`; :attr:`is_decode` is the
    test every reader makes (a mode is never compared with a string)."""

    chunk_size: int = 0
    evict_every: int = 1
    recall: Recall | None = None  # prefill only: what a question brings back from the cold tier (kvsieve/recall.py)

    def __post_init__(self) -> None:
        for name, least in (("chunk_size", 0), ("evict_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"a mode's {name} is an int >= {least}, got {value!r}")
        if self.evict_every != 1 and not self.chunk_size:
            raise ValueError(f"evict_every={self.evict_every} means decode-time eviction: give its chunk_size too")
        if self.recall is not None and not isinstance(self.recall, Recall):
            raise ValueError(f"a mode's recall is a Recall, got {self.recall!r}")
        if self.recall is not None and self.chunk_size:
            raise ValueError("recall is a prefill setting: a decode-time point evicts while it reads the question, "
                             "so there is no compressed context to recall into (drop one of them)")

    @property
    def is_decode(self) -> bool:
        """Decode-time eviction (the context read in chunks), not prefill compression."""
        return self.chunk_size > 0

    @property
    def name(self) -> str:
        return DECODE if self.is_decode else PREFILL

    @property
    def suffix(self) -> str:
        """What the stored label adds: ``""``, ``@decodeN`` or ``@decodeNeE``."""
        if self.recall is not None:
            return f"@{self.recall.text}"
        if not self.chunk_size:
            return ""
        return f"@decode{self.chunk_size}" + (f"e{self.evict_every}" if self.evict_every != 1 else "")

    @property
    def engine_options(self) -> dict[str, Any]:
        """What the engine (``attach``, ``generate``) is given for this mode: decode-time eviction with its chunk and
        eviction interval, or nothing (prefill compression, the engine's default)."""
        if self.recall is not None:
            return {"recall": self.recall}
        if not self.chunk_size:
            return {}
        return {"mode": DECODE, "chunk_size": self.chunk_size, "evict_every": self.evict_every}

    def __str__(self) -> str:
        return self.name


PREFILL_MODE = Mode()


@dataclass(frozen=True, eq=False)
class Point:
    """A policy run at a setting: ``spec`` (the policy spec's text; a :class:`PolicySpec` given here is kept, so its
    files are not read again), ``ratio`` in [0, 1), ``question_aware`` (the question kept out of a prefill
    compression) and ``mode``. Reading a point opens no file; :attr:`policy_spec` parses the spec when asked.

    Equal, hashed and ordered by (stored label, ratio, question-awareness)."""

    spec: str
    ratio: float = 0.0
    question_aware: bool = False
    mode: Mode = PREFILL_MODE
    parsed: PolicySpec | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        spec = self.spec
        if isinstance(spec, PolicySpec):
            object.__setattr__(self, "parsed", spec)
            spec = spec.text
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a point's policy is a non-empty policy spec, got {spec!r}")
        spec = spec.strip()
        if spec.endswith(QA_SUFFIX):
            raise ValueError(f"spec {spec!r} carries {QA_SUFFIX}: give question_aware=True, or read the whole label "
                             "with Point.parse")
        recall = _RECALL_SUFFIX.search(spec)
        if recall is not None:  # a stored label: its recall suffix is the mode
            if self.mode != PREFILL_MODE:
                raise ValueError(f"label {spec!r} names its recall, and mode={self.mode!r} was given too: give it once")
            object.__setattr__(self, "mode", Mode(recall=Recall.parse(recall["recall"])))
            spec = spec[: recall.start()].strip()
        if _ANY_DECODE_SUFFIX.search(spec):  # a stored label: its decode suffix is the mode
            match = _DECODE_SUFFIX.search(spec)
            if match is None:
                raise ValueError(f"bad label {spec!r}: a decode-time label ends in @decodeN or @decodeNeE "
                                 "(N the chunk size, E the generated tokens between evictions, both positive)")
            if self.mode != PREFILL_MODE:
                raise ValueError(f"label {spec!r} names its mode, and mode={self.mode!r} was given too: give it once")
            spec = spec[: match.start()].strip()
            object.__setattr__(self, "mode", Mode(int(match["chunk"]), int(match["every"] or 1)))
        if not spec:
            raise ValueError(f"a point's policy is a non-empty policy spec, got {self.spec!r}")
        object.__setattr__(self, "spec", spec)
        try:
            _family_of(spec)  # text only: a program's or checkpoint's file is not opened
        except ValueError as err:
            raise ValueError(f"policy {spec!r} is not a policy spec: {err}") from None
        ratio = self.ratio
        number = isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
        if not number or not math.isfinite(ratio) or not 0 <= ratio < 1:
            raise ValueError(f"policy {spec!r} has ratio {ratio!r}; a compression ratio is in [0, 1) (the fraction of "
                             f"the cache removed), so {ratio!r} is out of range")
        object.__setattr__(self, "ratio", float(ratio))
        if not isinstance(self.question_aware, bool):
            raise ValueError(f"policy {spec!r} has question_aware {self.question_aware!r}; allowed: true, false")
        if not isinstance(self.mode, Mode):
            raise ValueError(f"a point's mode is a Mode (prefill, or decode with its chunk), got {self.mode!r}")
        if self.mode.recall is not None:
            recall = self.mode.recall
            if not self.compresses:  # (at ratio 0 a label reads; such a point runs as full KV, recalling nothing)
                raise ValueError(f"policy {spec!r} evicts nothing: there is nothing to recall (drop the recall)")
            if not recall.fraction < 1 - self.ratio:
                raise ValueError(f"recall fraction {recall.fraction:g} is outside [0, {1 - self.ratio:g}): it must be "
                                 f"below the share the point at ratio {self.ratio:g} keeps")
            if self.question_aware:
                raise ValueError(f"policy {spec!r} is question-aware: it compresses after the question, so there is "
                                 "no later question to recall for (drop one of them)")
        if self.question_aware and self.mode.is_decode:
            raise ValueError(f"policy {self.stored!r} evicts at decode time, where the question is read under "
                             "eviction anyway: there is no question-aware decode-time point (drop question-awareness)")

    @classmethod
    def parse(cls, text: str, ratio: float = 0.0, question_aware: bool = False) -> Point:
        """Read a label ``SPEC``, ``SPEC@decodeN`` or ``SPEC@decodeNeE``, with an optional trailing ``+qa`` (which,
        like ``question_aware``, marks the point question-aware). ValueError for a malformed ``@decode`` suffix.
        (``Point(label, ratio)`` reads the decode suffix too; only ``+qa`` needs ``parse``.)"""
        if not isinstance(text, str):
            raise ValueError(f"a label is a string such as 'snapkv@decode128', got {type(text).__name__} {text!r}")
        text = text.strip()
        if text.endswith(QA_SUFFIX):
            text, question_aware = text[: -len(QA_SUFFIX)].rstrip(), True
        return cls(text, ratio, question_aware)

    def at(self, ratio: float) -> Point:
        """The same policy and setting at another ratio."""
        return Point(self.parsed or self.spec, ratio, self.question_aware, self.mode)

    # -- identity ----------------------------------------------------------------------------------------------
    def _key(self) -> tuple[str, float, bool]:
        return self.stored, self.ratio, self.question_aware

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __lt__(self, other: Point) -> bool:
        return self._key() < other._key()

    # -- text --------------------------------------------------------------------------------------------------
    @property
    def stored(self) -> str:
        """The store's ``policy`` column: the spec with its decode suffix, never ``+qa``."""
        return self.spec + self.mode.suffix

    @property
    def policy(self) -> str:
        """The stored label (a results row's and a contract's ``policy``)."""
        return self.stored

    @property
    def display(self) -> str:
        """The name tables and plots show: the stored form, with ``+qa`` when question-aware."""
        return self.stored + (QA_SUFFIX if self.question_aware else "")

    def __str__(self) -> str:
        return f"{self.display}@{self.ratio:g}"

    def as_dict(self) -> dict[str, Any]:
        """A results row's ``cell`` record (its stored form: the spec and the mode's two numbers)."""
        out = {"policy": self.spec, "ratio": self.ratio, "question_aware": self.question_aware,
               "chunk_size": self.chunk_size, "evict_every": self.evict_every}
        if self.mode.recall is not None:  # rows without recall keep the form every earlier row has
            out["recall"] = self.mode.recall.text
        return out

    @property
    def chunk_size(self) -> int:
        return self.mode.chunk_size

    @property
    def evict_every(self) -> int:
        return self.mode.evict_every

    # -- what the point is -------------------------------------------------------------------------------------
    @property
    def policy_spec(self) -> PolicySpec:
        """The spec parsed by the registry (its family class, parameters and file digest), once."""
        if self.parsed is None:
            object.__setattr__(self, "parsed", parse(self.spec))
        return self.parsed

    @property
    def family(self) -> str:
        """The family the spec calls (``snapkv`` for ``snapkv(window=32)``, ``program`` for ``program:PATH``)."""
        return _family_of(self.spec)

    @property
    def family_class(self) -> type[Policy] | None:
        """The family's registered class; None for a family this kvsieve does not register (an old row)."""
        try:
            return family_class(self.family)
        except ValueError:
            return None

    @property
    def is_full(self) -> bool:
        """The full cache (prefill or chunked): the reference, never a candidate."""
        return self.family == FULL_CACHE

    @property
    def is_reference(self) -> bool:
        """A reference line for reports, not for real use: the family's ``is_reference`` (the answer-span oracle)
        or a question-aware row. An unregistered family is not one."""
        cls = self.family_class
        return self.question_aware or (cls is not None and cls.is_reference)

    @property
    def compresses(self) -> bool:
        """Whether the policy evicts anything (at a ratio above 0): the family's ``evicts``; an unregistered
        family does."""
        cls = self.family_class
        return cls.evicts if cls is not None else not self.is_full

    @property
    def budget(self) -> Budget | None:
        """What the engine is given: ``Budget(ratio)``, or None where nothing is evicted (full KV, ratio 0)."""
        return Budget(ratio=self.ratio) if self.compresses and self.ratio > 0 else None

    @property
    def engine_options(self) -> dict[str, Any]:
        """What ``attach`` and ``generate`` are given for this point's mode (no recall where nothing is evicted)."""
        options = self.mode.engine_options
        return {k: v for k, v in options.items() if k != "recall"} if self.budget is None else options

    @property
    def protects_question(self) -> bool:
        """Whether the question's tokens are kept on top of the budget: a question-aware point (prefill, as every
        question-aware point is) that evicts."""
        return self.question_aware and self.budget is not None

    @property
    def setting(self) -> str:
        """What the point is, in words: the label a table and a contract show."""
        if self.mode.is_decode:
            return f"decode-time eviction every {self.chunk_size} tokens, question read under eviction"
        if self.mode.recall is not None:
            return f"query-agnostic prefill, {100 * self.mode.recall.fraction:g}% recalled per question"
        return "question-aware prefill" if self.question_aware else "query-agnostic prefill"

    @property
    def retention(self) -> float:
        """The nominal fraction kept, 1 - ratio (the bytes kept, sinks and window on top, are measured)."""
        return round(1.0 - self.ratio, 6)

    @property
    def reference(self) -> Point:
        """The full-KV point this one's rows are paired with: the same mode, nothing evicted (nothing to recall)."""
        return Point(FULL_CACHE, 0.0, False, Mode(self.chunk_size, self.evict_every))

    @property
    def sort_key(self) -> tuple[bool, bool, str]:
        """Where a row of this label goes in tables and legends: the full cache first, then ordinary policies, then
        reference ones (the oracle, question-aware rows), each group by display name."""
        return not self.is_full, self.is_reference, self.display


def display_order(points: Iterable[Point]) -> list[str]:
    """The display labels of ``points``, once each, in :attr:`Point.sort_key` order: every table and legend's order.
    It takes points, not labels: a report knows each label's point from its rows (the store keeps it), so no label's
    text is read back here."""
    return [p.display for p in sorted({p.display: p for p in points}.values(), key=lambda p: p.sort_key)]
