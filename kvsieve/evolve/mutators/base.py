"""The one interface every mutator implements."""

from __future__ import annotations

import random
from typing import Protocol

from kvsieve.language.program_source import Program

__all__ = ["Mutator"]


class Mutator(Protocol):
    """Anything that proposes a child source. ``None`` means no usable proposal (counted, never fatal)."""

    name: str

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None: ...
