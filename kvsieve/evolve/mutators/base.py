"""The one interface every mutator implements."""

from __future__ import annotations

import random
from typing import Protocol

from kvsieve.language.program_source import Program

__all__ = ["Mutator", "CHEAP_REPEAT_EDITS"]

# A child repeating an earlier program is edited again, up to this many times, before it is stored as a duplicate
# (search.py): a small neighbourhood (best-of-N's one edit of the seed, which the structural mutator exhausts after
# ~90 programs on Qwen) widens into random walks of several edits, still without reading any score. For mutators
# whose edit is a microsecond; a language model's call costs 13-45 s, so its repeats are stored at once.
CHEAP_REPEAT_EDITS = 4


class Mutator(Protocol):
    """Anything that proposes a child source. ``None`` means no usable proposal (counted, never fatal)."""

    name: str
    repeat_edits: int  # further proposals a repeat of an earlier program takes (CHEAP_REPEAT_EDITS or 0)

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None: ...
