"""A candidate policy: one small source file in the policy language, against the compact interface ``f``.

The file has exactly two parts, the editable block and the selection parameters::

    \"\"\"What it does.\"\"\"
    SELECTION = {"chunk_size": 1, "sink": 0}

    def score(f):
        return pool(group_mean(f.attn), 5)

``score(f)`` maps a :class:`~kvsieve.language.program_features.Features` to (b, h, n) scores, higher kept
first; ``SELECTION`` is a literal dict of the selection parameters a candidate may set (the
observation window, always kept, is the engine's).
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from functools import cached_property

from kvsieve.selection import Selection

__all__ = ["Program", "ProgramError", "SELECTION_RANGES", "SELECTION_DEFAULTS", "SELECTION_CHOICES",
           "parse_selection", "fields_read", "value_text"]

# name -> (smallest, largest) allowed int. "floor": the percent of its per-head budget every head keeps when
# budgets move between heads (AdaKV's safeguard, 20 by default; KVzip keeps one entry a head, i.e. 0).
SELECTION_RANGES = {"chunk_size": (1, 64), "sink": (0, 64), "floor": (0, 50)}
# a default other than the range's smallest
SELECTION_DEFAULTS = {"floor": 20}
# name -> allowed literal strings, the first the default. "allocation" moves the budget across the
# heads of a layer ("layer") or the whole model ("global"); a program's scores are then standardised
# per head first ("normalization": "zscore", the default), since nothing makes them comparable otherwise,
# unless the program says they already are ("none": e.g. f.surrogate, log KVzip scores on one scale).
SELECTION_CHOICES = {"allocation": ("uniform", "layer", "global"), "normalization": ("zscore", "none")}


def _defaults() -> dict[str, int | str]:
    return {**{name: SELECTION_DEFAULTS.get(name, lo) for name, (lo, _) in SELECTION_RANGES.items()},
            **{name: choices[0] for name, choices in SELECTION_CHOICES.items()}}


class ProgramError(ValueError):
    """A candidate that is not a well-formed program (the reason says what and where)."""


def value_text(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters, without converting a wide int to decimal (Python
    refuses one of more than 4300 digits) and whatever a literal holds (a tuple of such ints, deep nesting)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError, MemoryError):
        return f"a {type(value).__name__} that cannot be shown"
    return text if len(text) <= limit else text[:limit] + "..."


def parse_selection(source: str) -> dict[str, int | str]:
    """The ``SELECTION`` literal of a program, checked against ``SELECTION_RANGES`` and ``SELECTION_CHOICES``."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise ProgramError(f"syntax error at line {err.lineno}: {err.msg}") from None
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, deep nesting
        raise ProgramError(f"the source cannot be parsed: {type(err).__name__}") from None
    found = [node for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "SELECTION" for t in node.targets)]
    if not found:
        return _defaults()
    try:
        params = ast.literal_eval(found[-1].value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as err:  # {[]: 1} is a TypeError
        raise ProgramError(f"SELECTION must be a literal dict of names to ints or strings ({type(err).__name__})"
                           ) from None
    if not isinstance(params, dict):
        raise ProgramError(f"SELECTION must be a dict, got {type(params).__name__}")
    out = _defaults()
    for key, value in params.items():
        if key in SELECTION_CHOICES:
            if not isinstance(value, str) or value not in SELECTION_CHOICES[key]:
                raise ProgramError(f"SELECTION[{key!r}] = {value_text(value)} is not one of "
                                   f"{list(SELECTION_CHOICES[key])}")
            out[key] = value
            continue
        if key not in SELECTION_RANGES:
            allowed = ", ".join([*SELECTION_RANGES, *SELECTION_CHOICES])
            raise ProgramError(f"unknown SELECTION key {value_text(key)}; allowed: {allowed}")
        lo, hi = SELECTION_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ProgramError(f"SELECTION[{key!r}] = {value_text(value)} is outside the allowed ints [{lo}, {hi}]")
        out[key] = value
    if out["allocation"] != "uniform" and out["chunk_size"] > 1:
        # the Selection refuses it too, but only once the program is evaluated: fail at the static check
        raise ProgramError(f"SELECTION allocation {out['allocation']!r} moves budgets between heads, which whole "
                           f"chunks (chunk_size = {out['chunk_size']}) cannot: use chunk_size 1 or allocation "
                           "'uniform'")
    if out["allocation"] == "uniform" and out["floor"] != SELECTION_DEFAULTS["floor"]:
        # every head keeps the same number under "uniform": a floor would change nothing, so it is refused
        raise ProgramError(f"SELECTION floor = {out['floor']} applies only when budgets move between heads: use "
                           "allocation 'layer' or 'global', or leave floor out")
    return out


def fields_read(tree: ast.AST, fields: tuple[str, ...], param: str = "f") -> set[str]:
    """The names of ``fields`` a parsed program reads as ``PARAM.NAME`` (``f.attn``)."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == param and n.attr in fields}


@dataclass(frozen=True)
class Program:
    source: str

    @cached_property
    def selection_params(self) -> dict[str, int | str]:
        return parse_selection(self.source)

    def selection(self, window: int) -> Selection:
        params = self.selection_params
        allocation = params["allocation"]
        return Selection(sink=params["sink"], recent=window, chunk_size=params["chunk_size"], allocation=allocation,
                         normalization="none" if allocation == "uniform" else params["normalization"],
                         adaptive_floor=params["floor"] / 100)

    @cached_property
    def code_hash(self) -> str:
        """Hash of the normalised syntax tree: formatting, comments and docstrings (the module's and
        ``score``'s) do not make a new program."""
        try:
            tree = ast.parse(self.source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return hashlib.sha256(self.source.encode("utf-8", "replace")).hexdigest()[:16]
        for owner in [tree, *(n for n in tree.body if isinstance(n, ast.FunctionDef))]:
            body = owner.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                owner.body = body[1:]
        try:
            dumped = ast.dump(tree)
        except (ValueError, RecursionError, MemoryError):  # an int Python will not print, a chain `not not ... x`
            return hashlib.sha256(self.source.encode("utf-8", "replace")).hexdigest()[:16]
        return hashlib.sha256(dumped.encode()).hexdigest()[:16]
