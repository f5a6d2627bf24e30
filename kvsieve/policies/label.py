"""The label a results row is keyed by: a policy spec, how it was run, and whether it saw the question.

Stored form (the store's ``policy`` column): ``SPEC`` for prefill compression, ``SPEC@decodeN`` for
decode-time eviction (the context read in chunks of N tokens), ``SPEC@decodeNeE`` when generated tokens are
evicted every E > 1 of them. Display form (tables, plots, comparisons): the stored form with ``+qa`` appended
for a question-aware row (the question kept out of compression; the store keeps that in its own column).

:class:`Label` is the one parser and formatter of both forms: nothing else in kvsieve splits or builds a
label, or compares a policy or mode name as text. Reading a label opens no file: a store holds labels of
program files and checkpoints that may no longer exist, and its tables must still be drawn. A family that is
no longer registered (rows of an older kvsieve) reads as an ordinary compressing policy, not a reference.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from kvsieve.policies.registry import family_class
from kvsieve.policy import FullCache, Policy
from kvsieve.spec import parse_spec

__all__ = ["DECODE", "FULL_CACHE", "MODES", "PREFILL", "QA_SUFFIX", "Label", "display_order"]

FULL_CACHE: str = FullCache.name  # the full cache's spec and stored label (prefill); the reference of every row
PREFILL, DECODE = "prefill", "decode"
MODES = (PREFILL, DECODE)
QA_SUFFIX = "+qa"  # display only: the store records question-awareness in its own column

_DECODE_SUFFIX = re.compile(r"@decode(?P<chunk>[1-9][0-9]*)(?:e(?P<every>[1-9][0-9]*))?$")
_ANY_DECODE_SUFFIX = re.compile(r"@decode[^()]*$")  # what a decode suffix looks like, well formed or not


@lru_cache(maxsize=4096)
def _family_of(spec: str) -> str:
    """The family name a spec calls (text only: ``program:PATH`` opens nothing)."""
    return parse_spec(spec)[0]


@dataclass(frozen=True)
class Label:
    """One row's identity as text: ``spec`` (the policy spec's text), ``chunk_size`` (> 0: decode-time eviction
    reading the context in chunks of that many tokens), ``evict_every`` (decode mode: generated tokens between
    evictions) and ``question_aware`` (the question was kept out of a prefill compression)."""

    spec: str
    chunk_size: int = 0
    evict_every: int = 1
    question_aware: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValueError(f"a label's spec is a non-empty policy spec, got {self.spec!r}")
        if self.spec != self.spec.strip():
            object.__setattr__(self, "spec", self.spec.strip())
        if self.spec.endswith(QA_SUFFIX) or _ANY_DECODE_SUFFIX.search(self.spec):
            raise ValueError(f"spec {self.spec!r} carries a label suffix ({QA_SUFFIX} or @decode...): "
                             "read the whole label with Label.parse")
        for name, least in (("chunk_size", 0), ("evict_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"a label's {name} is an int >= {least}, got {value!r}")
        if self.evict_every != 1 and not self.chunk_size:
            raise ValueError(f"evict_every={self.evict_every} means decode-time eviction: give its chunk_size too")
        if not isinstance(self.question_aware, bool):
            raise ValueError(f"question_aware is true or false, got {self.question_aware!r}")

    @classmethod
    def parse(cls, text: str, question_aware: bool = False) -> Label:
        """Read ``SPEC``, ``SPEC@decodeN`` or ``SPEC@decodeNeE``, with an optional trailing ``+qa`` (which, like
        ``question_aware``, marks the label question-aware). ValueError for a malformed ``@decode`` suffix."""
        if not isinstance(text, str):
            raise ValueError(f"a label is a string such as 'snapkv@decode128', got {type(text).__name__} {text!r}")
        text = text.strip()
        if text.endswith(QA_SUFFIX):
            text, question_aware = text[: -len(QA_SUFFIX)].rstrip(), True
        match = _DECODE_SUFFIX.search(text)
        if match is None:
            if _ANY_DECODE_SUFFIX.search(text):
                raise ValueError(f"bad label {text!r}: a decode-time label ends in @decodeN or @decodeNeE "
                                 "(N the chunk size, E the generated tokens between evictions, both positive)")
            return cls(text, question_aware=question_aware)
        return cls(text[: match.start()], int(match["chunk"]), int(match["every"] or 1), question_aware)

    @property
    def stored(self) -> str:
        """The store's ``policy`` column: the spec with its decode suffix, never ``+qa``."""
        if not self.chunk_size:
            return self.spec
        return f"{self.spec}@decode{self.chunk_size}" + (f"e{self.evict_every}" if self.evict_every != 1 else "")

    @property
    def display(self) -> str:
        """The name tables and plots show: the stored form, with ``+qa`` when question-aware."""
        return self.stored + (QA_SUFFIX if self.question_aware else "")

    def __str__(self) -> str:
        return self.display

    @property
    def mode(self) -> str:
        """``decode`` (eviction while the context is read in chunks) or ``prefill`` (compression after it)."""
        return DECODE if self.chunk_size else PREFILL

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
        """Whether the policy evicts anything: the family's ``compresses``; an unregistered family does."""
        cls = self.family_class
        return cls.compresses if cls is not None else not self.is_full

    @property
    def reference(self) -> Label:
        """The full-cache label this one's rows are paired with: the same chunking, nothing evicted."""
        return Label(FULL_CACHE, self.chunk_size, self.evict_every)

    @property
    def sort_key(self) -> tuple[bool, bool, str]:
        """Where a row of this label goes in tables and legends: the full cache first, then ordinary policies, then
        reference ones (the oracle, question-aware rows), each group by display name."""
        return not self.is_full, self.is_reference, self.display


def display_order(labels: Iterable[str]) -> list[str]:
    """Labels (display or stored form), once each, in :attr:`Label.sort_key` order: every table and legend's order."""
    return sorted(set(labels), key=lambda text: Label.parse(text).sort_key)
