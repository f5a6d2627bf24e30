"""Stage 0 of the cascade: a program must be in the language and affordable at the reference shape.

The check is the language itself: the text is parsed into a typed graph (``typed_graph``: only bindings and
one returned expression of listed operations, every shape inferred) and priced by the cost model (``cost``)
at :data:`~kvsieve.language.cost.REFERENCE_DIMS` (32k entries x 8 KV heads x 4 query heads) under the
default :class:`~kvsieve.language.interpreter.Limits`. Nothing of the program runs. Every refusal is a
:class:`StaticCheckError` naming the line.
"""

from __future__ import annotations

from kvsieve.language.cost import REFERENCE_DIMS
from kvsieve.language.interpreter import InterpreterError, Limits, ScoreProgram

__all__ = ["StaticCheckError", "check_source"]


class StaticCheckError(ValueError):
    """A program outside the language or over its budgets (the message names the construct and its line)."""


def check_source(source: str, limits: Limits = Limits()) -> ScoreProgram:
    """The program of ``source``, priced at the reference shape; :class:`StaticCheckError` if it is not one."""
    try:
        program = ScoreProgram(source, limits=limits, filename="program")
        program.check_budgets(dict(REFERENCE_DIMS))
    except InterpreterError as err:
        raise StaticCheckError(str(err)) from None
    return program
