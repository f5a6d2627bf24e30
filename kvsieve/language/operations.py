"""Every operation a policy program may use, each with a typed signature, a shape rule and a measured cost.

This table is the language: the checker (``typed_graph``), the interpreter (``interpreter``), the cost model
(``cost``) and the exported grammar (``grammar``) are all read off it, so they cannot disagree on what a
program is.

Types. A value is a number (a literal, a scalar feature such as ``f.layer``) or a tensor of one of four
shape families over the symbolic dims ``b`` (batch), ``h`` (KV heads), ``g`` (query heads per KV head) and
``n`` (cached context entries): ``(n)``, ``(b, h, n)`` and ``(b, h, g, n)``. Two shapes combine as torch
broadcasts them, aligned on the right, but only where the symbols agree: ``(b, h, g, n) + (b, h, n)`` is
refused even when ``g == h`` happens to make torch accept it.

Cost. An operation's output has the elements of its shape; its time is ``overhead_ns + ns_per_element x
elements touched`` (x ``log2 n`` for the sort in ``rank``, x the kernel for the pools), its scratch the
temporaries torch allocates inside it. The constants come from ``benchmarks/language_cost.py`` (see
``cost.CALIBRATION``).

Values. A price per element holds only where an operation's time does not depend on the values, and the math
library's does: ``exp`` of an argument whose result leaves float32's normal range, ``log`` and ``sqrt`` of zero,
a negative, a subnormal, an infinity or NaN, ``sin`` and ``cos`` beyond 1e4 in magnitude or of an infinity take
slow paths 6 to 36 times the normal time (measured: ``benchmarks/language_cost.py --values``). So those six
operations read their argument inside the range where they are fast (:data:`GUARDED_RANGES`): NaN is read as 0
and anything beyond the range as its nearer end (an infinity included), which makes them total functions with
finite results (``log(0)`` is -87.3, ``sqrt(-1)`` 1.1e-19, ``exp(1000)`` 6.1e37, ``log(inf)`` 87.5). ``x ** k`` is
one cheap pass for k in :data:`FAST_POWERS` and torch's general ``pow`` otherwise, priced on its own. Number
literals are 0 or of magnitude in [:data:`LITERAL_MIN`, :data:`LITERAL_BOUND`] (a subnormal float32 cannot be
written), and numbers folded from them 0 or in [:data:`LITERAL_MIN`, :data:`FOLDED_BOUND`].
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsieve.language import program_features as feats
from kvsieve.language.program_source import value_text

__all__ = ["Dims", "SCALAR", "N", "BHN", "BHGN", "FEATURE_TYPES", "Operation", "BINARY_OPERATORS", "FUNCTIONS",
           "broadcast", "describe", "shape_text", "LITERAL_BOUND", "LITERAL_MIN", "FOLDED_BOUND", "KERNEL_RANGE",
           "POW_RANGE", "FAST_POWERS", "GUARDED_RANGES", "TypeRefusal", "check_number", "pow_cost"]

Dims = tuple[str, ...]
SCALAR: Dims = ()
N: Dims = ("n",)
BHN: Dims = ("b", "h", "n")
BHGN: Dims = ("b", "h", "g", "n")

# the largest magnitude of a numeric literal; kernel sizes and exponents have their own, smaller ranges
LITERAL_BOUND = 1e6
# the smallest magnitude of a nonzero number, written or folded (float32's subnormals start below 1.2e-38), and the
# largest of a number folded from literals (``1e6 * 1e6``)
LITERAL_MIN = 1e-30
FOLDED_BOUND = 1e30
KERNEL_RANGE = (1, 257)
POW_RANGE = (-4, 4)
# the exponents torch computes with one multiply pass (x * x * x, 1 / (x * x), ...); any other k runs its general pow
FAST_POWERS = (-2, -1, 0, 1, 2, 3)
# an integer literal wider than this is refused before anything converts or prints it (Python refuses to turn an int
# of more than 4300 digits into text, and a float cannot hold one of more than 1024 bits)
MAX_INT_BITS = 64

FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
FLOAT32_MAX = 3.4028234663852886e38
# the argument each guarded operation reads: NaN as 0, anything beyond the range as its nearer end. Inside these,
# torch's vectorised exp, log, log1p, sqrt, sin and cos run within 3x of their speed on ordinary values (AMD EPYC,
# torch 2.13: exp(-87.5) and exp(87.5) 11-36x slower, log / sqrt of 0, negatives, subnormals or infinities 6-36x,
# sqrt of float32's largest number 28x, sin / cos past ~1.2e4 5x, of an infinity 12x; outside FLOAT32_MAX itself,
# the largest float32 is kept out of the ranges; benchmarks/language_cost.py --values prints the table)
GUARDED_RANGES: dict[str, tuple[float, float]] = {
    "exp": (-87.0, 87.0), "log": (FLOAT32_TINY, 1e38), "log1p": (-1.0 + 2.0 ** -24, 1e38),
    "sqrt": (FLOAT32_TINY, 1e38), "sin": (-1e4, 1e4), "cos": (-1e4, 1e4),
}

FEATURE_TYPES: dict[str, Dims] = {"attn": BHGN, "last_attn": BHGN, "key_norm": BHN, "value_norm": BHN,
                                  "position": N, "surrogate": BHN,
                                  **{name: SCALAR for name in feats.SCALAR_FIELDS}}


class TypeRefusal(ValueError):
    """An operation applied to arguments of the wrong type (the checker adds the line)."""


def shape_text(shape: Dims) -> str:
    return "a number" if shape == SCALAR else "(" + ", ".join(shape) + ")"


def broadcast(a: Dims, b: Dims) -> Dims:
    """The shape of an elementwise operation on ``a`` and ``b``: aligned on the right, each symbol equal or absent."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else None
        y = b[-i] if i <= len(b) else None
        if x is not None and y is not None and x != y:
            raise TypeRefusal(f"cannot combine {shape_text(a)} with {shape_text(b)}: dims {x} and {y} differ "
                              "(reduce one with group_mean or group_max first)")
        out.append(x if x is not None else y)
    return tuple(reversed(out))


@dataclass(frozen=True)
class Operation:
    """One callable of the language.

    ``tensors``: how many tensor arguments it takes first; ``literals``: the kinds of the literal arguments
    after them ("kernel": an int in KERNEL_RANGE, "number": a bounded number); ``result``: the output shape
    from the tensor arguments' shapes (raising :class:`TypeRefusal`); ``run``: the torch computation;
    ``cost``: the calibration key; ``scratch``: temporaries inside it, in float32 elements per output
    element; ``touches``: "output" or "input" (reductions read g times what they write)."""

    name: str
    doc: str
    tensors: int
    literals: tuple[str, ...]
    result: Callable[..., Dims]
    run: Callable[..., object]
    cost: str
    scratch: float = 0.0
    touches: str = "output"


def _same(x: Dims) -> Dims:
    if x == SCALAR:
        raise TypeRefusal("needs a tensor, got a number")
    return x


def _along_n(x: Dims) -> Dims:
    if not x or x[-1] != "n":
        raise TypeRefusal(f"works along the context dim n, got {shape_text(x)}")
    return x


def _group(x: Dims) -> Dims:
    if x != BHGN:
        raise TypeRefusal(f"reduces the query heads of (b, h, g, n), got {shape_text(x)}")
    return BHN


def _pair(x: Dims, y: Dims) -> Dims:
    _same(x)
    _same(y)
    return broadcast(x, y)


def _clamp(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.clamp(x, min=lo, max=hi)


Unary = Callable[[torch.Tensor], torch.Tensor]


def _guarded(fn: Unary, lo: float, hi: float) -> Unary:
    """``fn`` reading its argument inside [lo, hi] (NaN as 0): the values never reach the math library's slow paths."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return fn(torch.nan_to_num(x, nan=0.0, posinf=hi, neginf=lo).clamp_(lo, hi))

    run.__name__ = getattr(fn, "__name__", "guarded")
    return run


def _elementwise(name: str) -> Unary:
    fn = getattr(torch, name)
    return _guarded(fn, *GUARDED_RANGES[name]) if name in GUARDED_RANGES else fn


# name -> (doc, calibration class): a memory-bound pass ("cheap"), a transcendental read through its guard ("exp",
# GUARDED_RANGES: the guard's two passes are in the price), the logistic sigmoid, trigonometry (guarded), tanh
_ELEMENTWISE = {
    "abs": ("absolute value", "cheap"), "exp": ("exponential (x read inside [-87, 87])", "exp"),
    "log": ("natural logarithm (x read inside [1.2e-38, 1e38])", "exp"),
    "log1p": ("log(1 + x) (x read inside (-1, 1e38])", "exp"),
    "sqrt": ("square root (x read inside [1.2e-38, 1e38])", "exp"), "sigmoid": ("logistic sigmoid", "sigmoid"),
    "tanh": ("hyperbolic tangent", "tanh"), "relu": ("max(x, 0)", "cheap"), "sign": ("-1, 0 or 1", "cheap"),
    "square": ("x * x", "cheap"), "sin": ("sine (x read inside [-1e4, 1e4])", "trig"),
    "cos": ("cosine (x read inside [-1e4, 1e4])", "trig"),
}

FUNCTIONS: dict[str, Operation] = {
    # the helpers of program_features (the names a program calls bare)
    "pool": Operation("pool", "mean over a centred window of k entries along n, zero padded", 1, ("kernel",),
                      _along_n, feats.pool, "pool", scratch=1.0),
    "max_pool": Operation("max_pool", "max over a centred window of k entries along n", 1, ("kernel",),
                          _along_n, feats.max_pool, "max_pool", scratch=1.0),
    "normalize": Operation("normalize", "x divided by its largest magnitude along n", 1, (), _along_n,
                           feats.normalize, "normalize", scratch=1.0),
    "unit_mean": Operation("unit_mean", "x divided by its mean magnitude along n", 1, (), _along_n,
                           feats.unit_mean, "unit_mean", scratch=1.0),
    "rank": Operation("rank", "rank along n scaled to [0, 1]", 1, (), _along_n, feats.rank, "rank",
                      scratch=10.0),
    "group_mean": Operation("group_mean", "(b, h, g, n) -> (b, h, n): mean over the query heads", 1, (), _group,
                            feats.group_mean, "group", touches="input"),
    "group_max": Operation("group_max", "(b, h, g, n) -> (b, h, n): max over the query heads", 1, (), _group,
                           feats.group_max, "group", touches="input"),
    # torch functions (called as torch.NAME)
    **{f"torch.{name}": Operation(f"torch.{name}", doc, 1, (), _same, _elementwise(name), cost,
                                  scratch=1.0 if name in GUARDED_RANGES else 0.0)
       for name, (doc, cost) in _ELEMENTWISE.items()},
    "torch.maximum": Operation("torch.maximum", "elementwise larger of two tensors", 2, (), _pair, torch.maximum,
                               "binary"),
    "torch.minimum": Operation("torch.minimum", "elementwise smaller of two tensors", 2, (), _pair, torch.minimum,
                               "binary"),
    "torch.clamp": Operation("torch.clamp", "x limited to [lo, hi] (two numbers)", 1, ("number", "number"), _same,
                             _clamp, "cheap"),
}

# the infix operators: (symbol, precedence level in the grammar, torch/Python function)
BINARY_OPERATORS: dict[str, Callable[[object, object], object]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def pow_literal(value: object) -> int:
    """The exponent of ``x ** k``: an int literal in POW_RANGE."""
    lo, hi = POW_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TypeRefusal(f"the exponent of ** must be an int literal in [{lo}, {hi}], got {value_text(value)}")
    return value


def pow_cost(k: int) -> str:
    """The calibration class of ``x ** k``: one multiply pass for the exponents of FAST_POWERS, else torch's pow."""
    return "pow" if k in FAST_POWERS else "pow_general"


def check_number(value: float | int, what: str = "numbers") -> None:
    """Refuse a number outside {0} and [LITERAL_MIN, FOLDED_BOUND] in magnitude (ints compared as ints)."""
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TypeRefusal(f"{what} are bounded by {FOLDED_BOUND:g} in magnitude, got {value_text(value)}")
    if not math.isfinite(value):
        raise TypeRefusal(f"{what} must be finite, got {value_text(value)}")
    if value != 0 and not LITERAL_MIN <= abs(value) <= FOLDED_BOUND:
        raise TypeRefusal(f"{what} are 0 or of magnitude in [{LITERAL_MIN:g}, {FOLDED_BOUND:g}], got "
                          f"{value_text(value)}")


def check_literal(kind: str, value: object) -> float | int:
    """A literal argument of ``kind`` ("kernel" or "number") checked against its range, its size before anything
    converts it (an int of thousands of digits can be neither a float nor printed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeRefusal(f"expects a number literal, got {type(value).__name__}")
    if kind == "kernel":
        lo, hi = KERNEL_RANGE
        if not isinstance(value, int) or not lo <= value <= hi:
            raise TypeRefusal(f"kernel size must be an int literal in [{lo}, {hi}], got {value_text(value)}")
        return value
    too_wide = isinstance(value, int) and value.bit_length() > MAX_INT_BITS
    if too_wide or not math.isfinite(value) or abs(value) > LITERAL_BOUND:
        raise TypeRefusal(f"numbers are bounded by {LITERAL_BOUND:g} in magnitude, got {value_text(value)}")
    if value != 0 and abs(value) < LITERAL_MIN:
        raise TypeRefusal(f"a nonzero number is at least {LITERAL_MIN:g} in magnitude, got {value_text(value)}")
    return value


def warm_up(x: torch.Tensor) -> None:
    """Run every operation once on ``x`` (b, h, g, n), so torch's lazy initialisation happens now (the sandbox
    worker calls it before its guards refuse new imports)."""
    for op in FUNCTIONS.values():
        literals = [3 if kind == "kernel" else 1.0 for kind in op.literals]
        op.run(*([x] * op.tensors), *literals)
    for fn in BINARY_OPERATORS.values():
        fn(fn(x, x), 2.0)
    _ = -x ** 2 + x ** 4  # a fast power and torch's general pow


def _signature(op: Operation) -> str:
    tensors = ["x", "y"][:op.tensors]
    literals = {"kernel": f"k (int literal in [{KERNEL_RANGE[0]}, {KERNEL_RANGE[1]}])", "number": "number literal"}
    names = ["lo", "hi"] if op.name == "torch.clamp" else []
    args = [*tensors, *(names[i] if names else literals[kind] for i, kind in enumerate(op.literals))]
    return f"{op.name}({', '.join(args)})"


def describe() -> list[str]:
    """The language in a few lines, for people and for an LLM mutator's prompt (read off the tables)."""
    fields = ", ".join(f"f.{name} {shape_text(shape)}" for name, shape in FEATURE_TYPES.items())
    return [
        "score(f) is bindings `name = expression` and one final `return expression` of shape (b, h, n).",
        f"An expression is a feature, a number literal (0 or {LITERAL_MIN:g} <= |x| <= {LITERAL_BOUND:g}), a bound "
        f"name, + - * /, unary -, x ** k (int literal k in [{POW_RANGE[0]}, {POW_RANGE[1]}]) or one of these calls:",
        *(f"- {_signature(op)}: {op.doc}" for op in FUNCTIONS.values()),
        "A guarded operation reads a value beyond its range as the range's nearer end and NaN as 0, so its result "
        "is finite.",
        f"Features and their shapes: {fields}.",
        "Shapes combine only where their dims agree, aligned on the right: (b, h, n) with (n) or a number, "
        "never (b, h, g, n) with (b, h, n); reduce g first with group_mean or group_max.",
        "Nothing else exists: no loops, if, comparisons, indexing, methods, keywords, tuples or imports.",
    ]
