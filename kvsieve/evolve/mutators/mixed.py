"""The mixed mutator: structural edits of the parent, or random terms grafted into it (issue 50's "mixed" arms).

With probability ``random_share`` (fixed: ``RANDOM_SHARE``) a proposal is a graft: with probability ``whole_share``
(``WHOLE_SHARE``) the parent's whole return expression is replaced by a fresh random expression (one to three
weighted, unit-scaled terms, :func:`random_programs.random_expression`: the draws of the ``random`` arm), its bindings
and ``SELECTION`` kept; otherwise one subexpression of the parent's ``score`` (a call, an arithmetic operation or a
feature ``f.NAME``, chosen uniformly) is replaced by one random term (:func:`random_programs.random_term`). A graft
the language refuses (a term of the wrong shape for its place) is drawn again, at most ``TRIES`` times. Every other
proposal, and a graft that found no accepted form, is the structural mutator's edit of the parent.

The random part draws from the same generator as the ``random`` control, so the arms differ only in what a child
starts from: evolution (``evolve_mixed``) grafts into and edits the programs selection kept, best-of-N
(``best_of_n_mixed``) always the seed. Every draw comes from the ``rng`` the loop passes: a run is reproducible.
"""

from __future__ import annotations

import ast
import random

from kvsieve.evolve.mutators.base import CHEAP_REPEAT_EDITS
from kvsieve.evolve.mutators.random_programs import random_expression, random_term
from kvsieve.evolve.mutators.structural import (
    StructuralMutator,
    _drop_dead_assignments,
    _expr,
    _final_return,
    _replace,
    _score_def,
    _set_docstring,
)
from kvsieve.language.program_source import Program, ProgramError
from kvsieve.language.static_check import StaticCheckError, check_source

__all__ = ["MixedMutator", "RANDOM_SHARE", "WHOLE_SHARE", "TRIES"]

RANDOM_SHARE = 0.5  # of proposals: a graft of random terms (fixed before the study's held-out scores were read)
WHOLE_SHARE = 0.5  # of grafts: the whole return expression replaced
TRIES = 20


def _sites(fn: ast.FunctionDef) -> list[ast.expr]:
    """The subexpressions a term may replace: calls (not their function names), arithmetic and features."""
    names = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    sites = []
    for node in ast.walk(fn):
        if id(node) in names:
            continue
        if isinstance(node, (ast.Call, ast.BinOp)) or (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "f"):
            sites.append(node)
    return sites


class MixedMutator:
    """Structural edits or random grafts (see the module docstring)."""

    name = "mixed"
    repeat_edits = CHEAP_REPEAT_EDITS

    def __init__(self, random_share: float = RANDOM_SHARE, whole_share: float = WHOLE_SHARE) -> None:
        for label, value in (("random_share", random_share), ("whole_share", whole_share)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {value!r}")
        self.random_share = random_share
        self.whole_share = whole_share
        self.structural = StructuralMutator()
        self.proposed = 0
        self.failed = 0
        self.last_operation = ""

    def propose(self, parent: Program, inspirations: list[Program], rng: random.Random) -> Program | None:
        self.proposed += 1
        if rng.random() < self.random_share:
            child = self._graft(parent, rng, whole=rng.random() < self.whole_share)
            if child is not None:
                return child
        child = self.structural.propose(parent, inspirations, rng)
        if child is None:
            self.failed += 1
            return None
        self.last_operation = self.structural.last_operation
        return child

    def _graft(self, parent: Program, rng: random.Random, whole: bool) -> Program | None:
        """The parent with its return expression (``whole``) or one subexpression replaced by random terms, as
        the language accepts it; None when no draw in ``TRIES`` is accepted or differs from the parent."""
        for _ in range(TRIES):
            try:
                tree = ast.parse(parent.source)
                fn = _score_def(tree)
            except (SyntaxError, ProgramError):
                return None
            ret = _final_return(fn)
            if ret is None or ret.value is None:
                return None
            if whole:
                ret.value = _expr(random_expression(rng))
                operation = "random_return"
            else:
                sites = _sites(fn)
                if not sites:
                    return None
                target = sites[rng.randrange(len(sites))]
                term = _expr(random_term(rng))
                if target is ret.value:
                    ret.value = term
                elif not _replace(fn, target, term):
                    continue
                operation = "graft"
            _drop_dead_assignments(fn)
            _set_docstring(tree, f"Evolved: {operation} of a parent program.")
            child = Program(ast.unparse(ast.fix_missing_locations(tree)) + "\n")
            try:
                check_source(child.source)
                child.selection_params  # noqa: B018 - parses SELECTION, raises if out of range
            except (StaticCheckError, ProgramError):
                continue
            if child.code_hash != parent.code_hash:
                self.last_operation = operation
                return child
        return None
