"""Random programs: the control that reads neither a parent nor any score (issue 50's "random programs" arm).

Each proposal is a fresh program drawn from the same vocabulary the structural mutator edits with: one to three
terms, each a signal of ``structural.TERMS`` (its pooling kernel redrawn from ``structural.KERNELS``) put on a unit
scale by one of the scale helpers and weighted by one of ``WEIGHTS``, summed; and a ``SELECTION`` drawn from the
same options as the structural mutator's ``selection`` edit (chunks of 1 when the allocation is not uniform and the
default floor when it is, as the language requires), drawn again until the language's static check accepts it.
Every draw comes from the ``rng`` the loop passes, so a run is reproducible; the parent and the inspirations are
ignored.
"""

from __future__ import annotations

import random
import re

from kvsieve.evolve.mutators.base import CHEAP_REPEAT_EDITS
from kvsieve.evolve.mutators.structural import KERNELS, SELECTION_OPTIONS, TERMS
from kvsieve.language.program_source import SELECTION_DEFAULTS, Program, ProgramError
from kvsieve.language.static_check import StaticCheckError, check_source

__all__ = ["RandomProgramMutator", "random_term", "random_expression", "random_source", "SCALES", "WEIGHTS"]

SCALES = ("unit_mean", "normalize", "rank")
WEIGHTS = (0.1, 0.2, 0.3, 0.5, 1.0)
_KERNEL = re.compile(r", (\d+)\)")
TRIES = 50


def random_term(rng: random.Random) -> str:
    """One weighted, unit-scaled term: ``WEIGHT * SCALE(SIGNAL)``, the signal's pooling kernel redrawn."""
    signal = _KERNEL.sub(lambda _: f", {rng.choice(KERNELS)})", rng.choice(TERMS))
    return f"{rng.choice(WEIGHTS)} * {rng.choice(SCALES)}({signal})"


def random_expression(rng: random.Random) -> str:
    """A sum of one to three :func:`random_term` s."""
    return " + ".join(random_term(rng) for _ in range(rng.randint(1, 3)))


def random_source(rng: random.Random) -> str:
    """One random program's text (see the module docstring)."""
    expression = random_expression(rng)
    selection = {key: rng.choice(options) for key, options in SELECTION_OPTIONS.items()}
    if selection["allocation"] != "uniform":  # budgets moved between heads cannot move whole chunks
        selection["chunk_size"] = 1
    else:  # and a floor means nothing where they do not move
        selection["floor"] = SELECTION_DEFAULTS["floor"]
    return (f'"""Random program."""\nSELECTION = {selection!r}\n\n\ndef score(f):\n'
            f"    return {expression}\n")


class RandomProgramMutator:
    """``propose`` returns a fresh random program (:func:`random_source`) whatever the parent."""

    name = "random"
    repeat_edits = CHEAP_REPEAT_EDITS

    def __init__(self) -> None:
        self.proposed = 0
        self.failed = 0
        self.last_operation = ""

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None:
        """A random program the language accepts (stage 0 and its ``SELECTION``): drawn again, from the same
        ``rng``, while it is not (e.g. a sum of terms none of which has the score's shape), at most ``TRIES`` times."""
        self.proposed += 1
        for _ in range(TRIES):
            child = Program(random_source(rng))
            try:
                check_source(child.source)
                child.selection_params  # noqa: B018 - parses SELECTION, raises if out of range
            except (StaticCheckError, ProgramError):
                continue
            self.last_operation = "random"
            return child
        self.failed += 1
        return None
