"""The language's grammar, generated from the operations table, for constrained decoding and for readers.

Two start rules share one set of terminals:

* ``program``: the syntax of every program (a docstring, ``SELECTION``, ``def score(f):`` with bindings and a
  return; comments and blank lines allowed). Names are untyped here: the checker (``typed_graph``) types them, and
  refuses what this rule cannot see (unbound names, wrong types, nesting, costs). Its literals are bounded in
  length (at most 7 digits before the point, 8 after, an exponent of 2 digits, a one-digit power), so none is too
  wide for Python to read or print.
* ``typed_program``: one canonical form in which *every* string is a program the checker accepts, by construction
  (:func:`bounds` derives each budget's worst case from the rules and ``tests/language/test_grammar.py`` holds it to
  the checker's limits): a SELECTION the selection accepts and a single returned expression typed by its shape
  family (``e3`` is (b, h, n), ``e4`` (b, h, g, n), ``e1`` (n)) nested at most :data:`TYPED_DEPTH` levels (rules
  ``e3_0`` .. ``e3_D``, level 0 only features), so it has at most 2^D - 1 operations of the call's tensors;
  ``rank`` and ``pool`` (priced by their sort and their kernel) take (b, h, n) or (n), never (b, h, g, n); literals
  are positive and within their ranges; and no form makes a value that is not finite from finite features: a
  division is by a positive literal, by ``f.window``, ``f.n`` or ``f.group`` (never ``f.layer``, 0 at the first
  layer) or by ``(c + torch.abs(x))`` with a positive literal c (never by a feature such as ``f.position``, 0 at the
  first entry), and a power is 2 or 3 (no reciprocal). This is what an LLM mutator decodes under.

:func:`lark_text` renders them for Lark, :func:`decoding_lark` the typed one for llguidance (what the
constrained mutator decodes under), :func:`gbnf_text` the typed one for xgrammar / llama.cpp (GBNF);
:func:`sample` draws random strings of ``typed_program`` (the tests check each one passes stage 0, and 95% stage 1).
The files in ``docs/grammar/`` are these texts (``python -m kvsieve.language.grammar docs/grammar``).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvsieve.language import operations as ops
from kvsieve.language.cost import BYTES_PER_ELEMENT, CALL_OVERHEAD_NS, REFERENCE_DIMS, node_time_ns
from kvsieve.language.program_source import SELECTION_CHOICES, SELECTION_RANGES
from kvsieve.language.typed_graph import Node, TypedGraph

__all__ = ["typed_rules", "lark_text", "decoding_lark", "gbnf_text", "sample", "number_text", "bounds", "GrammarBounds",
           "TERMINALS", "TYPED_DEPTH", "DECODING_DEPTH"]

# terminal -> (Lark regex, GBNF expression)
TERMINALS: dict[str, tuple[str, str]] = {
    "NUMBER": (r"/(?:[1-9][0-9]{0,5}(?:\.[0-9]{1,4})?|0\.[0-9]{0,3}[1-9])/",
               r'[1-9] [0-9]{0,5} ("." [0-9]{1,4})? | "0." [0-9]{0,3} [1-9]'),
    "KERNEL": (r"/(?:25[0-7]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[1-9])/",
               r'"25" [0-7] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [1-9]'),
    "POWER": (r"/[23]/", r"[23]"),
    "CHUNK": (r"/(?:6[0-4]|[1-5][0-9]|[1-9])/", r'"6" [0-4] | [1-5] [0-9] | [1-9]'),
    "SINK": (r"/(?:6[0-4]|[1-5][0-9]|[0-9])/", r'"6" [0-4] | [1-5] [0-9] | [0-9]'),
    "FLOOR": (r"/(?:50|[1-4][0-9]|[0-9])/", r'"50" | [1-4] [0-9] | [0-9]'),
}
# the powers of the typed form: no reciprocal (x ** -1 of a feature that is 0 somewhere is not finite), no ** 0 (a
# constant), none of torch's general pow (FAST_POWERS only)
TYPED_POWERS = (2, 3)

# the terminals that spell a SELECTION int, and its key in SELECTION_RANGES
_SELECTION_TERMINALS = {"CHUNK": "chunk_size", "SINK": "sink", "FLOOR": "floor"}
_TYPES = {"e1": ops.N, "e3": ops.BHN, "e4": ops.BHGN}
_OF_SHAPE = {shape: name for name, shape in _TYPES.items()}
# what may be combined with a value of each type and keep it: itself, smaller tensor families, numbers
_PARTNERS = {"e1": ("e1",), "e3": ("e3", "e1"), "e4": ("e4", "e1")}
_SCALAR_FIELDS = [name for name, shape in ops.FEATURE_TYPES.items() if shape == ops.SCALAR]
# a number a tensor may be divided by: positive literals and the scalar features that are never 0 (f.layer is 0 at
# the first layer)
_DIVISOR_FIELDS = [name for name in _SCALAR_FIELDS if name != "layer"]
# operations priced by a sort or a kernel: on (b, h, g, n) one of them costs g times as much, and the typed form
# takes them only after the query heads are reduced (group_mean / group_max first)
_REDUCED_ONLY = ("rank", "pool")

TYPED_DEPTH = 4  # nesting of typed_program's expressions (the kept programs nest 3 to 4 deep)
DECODING_DEPTH = TYPED_DEPTH  # the constrained mutator decodes under typed_program itself


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class _Op:
    """An operation an alternative applies, for :func:`bounds`: its node's kind and name, result and argument
    types ("" a number), literals (the largest the terminals allow)."""

    kind: str
    name: str
    out: str
    args: tuple[str, ...]
    literals: tuple = ()


@dataclass(frozen=True)
class _Alt:
    symbols: tuple[str, ...]
    ops: tuple[_Op, ...] = ()


def _calls(result: str) -> list[_Alt]:
    """The call alternatives whose result has type ``result``, read off the operations table."""
    alternatives = []
    for op in ops.FUNCTIONS.values():
        for arg_type, arg_shape in _TYPES.items():
            if op.name in _REDUCED_ONLY and arg_type == "e4":
                continue
            try:
                out = op.result(*([arg_shape] * op.tensors))
            except ops.TypeRefusal:
                continue
            if _OF_SHAPE.get(out) != result:
                continue
            literals, worst = [], []
            for i, kind in enumerate(op.literals):
                literals += ['", "', "KERNEL" if kind == "kernel" else ("NUMBER" if i else "NEG_NUMBER")]
                worst.append(ops.KERNEL_RANGE[1] if kind == "kernel" else 1.0)
            args = [arg_type] if op.tensors == 1 else [arg_type, '", "', arg_type]
            node = _Op("call", op.name, result, (arg_type,) * op.tensors, tuple(worst))
            alternatives.append(_Alt((_q(op.name + "("), *args, *literals, '")"'), (node,)))
    return alternatives


def _arithmetic(name: str) -> list[_Alt]:
    """``+ - *`` with a partner on either side, ``/`` only by what cannot be 0, and the typed powers."""
    alternatives = [_Alt(('"("', name, '" ** "', "POWER", '")"'), (_Op("pow", "**", name, (name,), (3,)),))]
    for symbol in ("+", "-", "*"):
        for partner in (*_PARTNERS[name], "scalar"):
            operand = "" if partner == "scalar" else partner
            node = _Op("binary", symbol, name, (name, operand))
            alternatives.append(_Alt(('"("', name, _q(f" {symbol} "), partner, '")"'), (node,)))
            if partner != name:
                alternatives.append(_Alt(('"("', partner, _q(f" {symbol} "), name, '")"'), (node,)))
    divide = _Op("binary", "/", name, (name, ""))
    alternatives.append(_Alt(('"("', name, '" / "', "divisor", '")"'), (divide,)))
    for partner in (*_PARTNERS[name], "scalar"):  # x / (c + |y|), c a positive literal: never 0, never a NaN
        guard = (_Op("call", "torch.abs", partner, (partner,)), _Op("binary", "+", partner, (partner, "")))
        if partner != "scalar":
            alternatives.append(_Alt(('"("', name, '" / ("', "NUMBER", '" + torch.abs("', partner, '")))"'),
                                     (*guard, _Op("binary", "/", name, (name, partner)))))
        if partner != name:
            numerator = "" if partner == "scalar" else partner
            alternatives.append(_Alt(('"("', partner, '" / ("', "NUMBER", '" + torch.abs("', name, '")))"'),
                                     (_Op("call", "torch.abs", name, (name,)), _Op("binary", "+", name, (name, "")),
                                      _Op("binary", "/", name, (numerator, name)))))
    return alternatives


def _alternatives(depth: int) -> dict[str, list[_Alt]]:
    """``typed_program``'s rules at nesting ``depth`` (see :func:`typed_rules`), each alternative with the
    operations it applies."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"the typed grammar's depth must be an int >= 1, got {depth!r}")

    # Each alternative differs from the others at a literal neither of which is a prefix of the other: llguidance's
    # lexer is greedy, and a literal that is a prefix of another (`"chunk_size": ` of `"chunk_size": 1, ...`) made
    # it refuse `"chunk_size": 14` where Lark's Earley parser accepts it.
    sink = ('"SELECTION = {\\"sink\\": "', "SINK")
    moving = (*sink, '", \\"allocation\\": "', "MOVING", '", \\"normalization\\": "', "NORMALIZATION")
    rules: dict[str, list[_Alt]] = {
        "typed_program": [_Alt(('"\\"\\"\\"Evolved policy.\\"\\"\\"\\n"', "selection",
                                '"\\ndef score(f):\\n    return "', f"e3_{depth}", '"\\n"'))],
        "selection": [
            _Alt((*sink, '", \\"chunk_size\\": "', "CHUNK", '"}\\n"')),  # uniform, chunks of any size
            # budgets moved between heads (chunks of 1, the default), a normalisation, a floor only here (the
            # selection refuses one under "uniform")
            _Alt((*moving, '"}\\n"')),
            _Alt((*moving, '", \\"floor\\": "', "FLOOR", '"}\\n"')),
        ],
        "MOVING": [_Alt((_q(_q(choice)),)) for choice in SELECTION_CHOICES["allocation"] if choice != "uniform"],
        "NORMALIZATION": [_Alt((_q(_q(choice)),)) for choice in SELECTION_CHOICES["normalization"]],
        "scalar": [_Alt(("NUMBER",)), *(_Alt((_q(f"f.{name}"),)) for name in _SCALAR_FIELDS)],
        "divisor": [_Alt(("NUMBER",)), *(_Alt((_q(f"f.{name}"),)) for name in _DIVISOR_FIELDS)],
        "NEG_NUMBER": [_Alt(("NUMBER",)), _Alt(('"-"', "NUMBER"))],
    }
    for level in range(depth + 1):
        for name, shape in _TYPES.items():
            if level == 0:
                rules[f"{name}_0"] = [_Alt((_q(f"f.{field}"),)) for field, fshape in ops.FEATURE_TYPES.items()
                                      if fshape == shape]
                continue

            def down(symbol: str, level: int = level) -> str:  # the rule of a sub-expression one level down
                return f"{symbol}_{level - 1}" if symbol in _TYPES else symbol

            alternatives = [_Alt(tuple(down(s) for s in alt.symbols), alt.ops)
                            for alt in (*_calls(name), *_arithmetic(name))]
            alternatives.append(_Alt((down(name),)))  # a shallower expression is one too
            rules[f"{name}_{level}"] = alternatives
    return rules


def typed_rules(depth: int = TYPED_DEPTH) -> dict[str, list[list[str]]]:
    """``typed_program``'s rules: name -> alternatives, each a list of symbols (a quoted literal, a terminal or a
    rule name). ``depth`` bounds the nesting (rules ``e3_0`` .. ``e3_D``, level 0 only features), so every
    derivation ends and stays inside the checker's limits (:func:`bounds`)."""
    return {name: [list(alt.symbols) for alt in alts] for name, alts in _alternatives(depth).items()}


def _syntax_grammar() -> str:
    """``program``: the syntax of any program, names untyped (Lark, Earley)."""
    functions = " | ".join(_q(name) for name in sorted(ops.FUNCTIONS, key=len, reverse=True))
    return "\n".join([
        "program: _NL* (DOCSTRING _NL+)? (top _NL+)* top _NL*",
        "top: selection_dict | score_def",
        'selection_dict: "SELECTION" "=" "{" (entry ("," entry)* ","?)? "}"',
        'entry: STRING ":" (SIGNED | STRING)',
        'score_def: "def" "score" "(" "f" ")" ":" _NL+ (DOCSTRING _NL+)? (binding _NL+)* "return" expr',
        'binding: NAME "=" expr',
        "?expr: term | expr ADDOP term",
        "?term: factor | term MULOP factor",
        '?factor: power | "-" factor | "+" factor',
        '?power: atom | atom "**" "-"? INT',
        '?atom: LITERAL | NAME | "f" "." NAME | call | "(" expr ")"',
        f'call: ({functions}) "(" expr ("," expr)* ")"',
        'ADDOP: "+" | "-"',
        'MULOP: "*" | "/"',
        "LITERAL: /[0-9]{1,7}(\\.[0-9]{0,8})?([eE][-+]?[0-9]{1,2})?/ | /\\.[0-9]{1,8}([eE][-+]?[0-9]{1,2})?/",
        "SIGNED: /-?[0-9]{1,3}/",
        "INT: /[0-9]/",
        "NAME: /[A-Za-z_][A-Za-z_0-9]*/",
        "STRING: /\"[^\"\\n]*\"|'[^'\\n]*'/",
        'DOCSTRING: /"""(.|\\n)*?"""/',
        "_NL: /\\r?\\n/",
        "%ignore /[ \\t]+/",
        "%ignore /#[^\\n]*/",
    ])


def _typed_lines(depth: int, separator: str) -> list[str]:
    lines = []
    for name, alternatives in typed_rules(depth).items():
        glue = " | " if name.isupper() else separator  # a terminal made of choices stays on one line
        lines.append(f"{name}: " + glue.join(" ".join(alt) for alt in alternatives))
    return lines + [f"{name}: {regex}" for name, (regex, _) in TERMINALS.items()]


def lark_text() -> str:
    """Both start rules for Lark: ``Lark(lark_text(), start="program" | "typed_program", parser="earley")``."""
    lines = ["// kvsieve policy programs, generated from kvsieve/language/operations.py by kvsieve.language.grammar",
             "// start rules: program (the syntax of any program), typed_program (every string a checked program,",
             f"// expressions nested at most {TYPED_DEPTH} deep: kvsieve.language.grammar.bounds)",
             "", _syntax_grammar(), ""]
    return "\n".join([*lines, *_typed_lines(TYPED_DEPTH, "\n    | ")]) + "\n"


def decoding_lark(fenced: bool = True, depth: int = DECODING_DEPTH) -> str:
    """``typed_program`` (nesting bounded by ``depth``) as a Lark grammar for llguidance (start rule ``start``);
    ``fenced`` wraps it in a ```python block, the reply format the LLM mutators ask for."""
    start = '"```python\\n" typed_program "```"' if fenced else "typed_program"
    return "\n".join([f"start: {start}", *_typed_lines(depth, " | ")]) + "\n"


def gbnf_text() -> str:
    """``typed_program`` as GBNF (root = typed_program), for xgrammar or llama.cpp."""
    lines = ["# kvsieve typed policy programs, generated by kvsieve.language.grammar from operations.py",
             f"# every string a program the checker accepts; expressions nested at most {TYPED_DEPTH} deep",
             "root ::= typed-program"]

    def symbol(s: str) -> str:
        return s if s.startswith('"') else s.lower().replace("_", "-")

    for name, alternatives in typed_rules(TYPED_DEPTH).items():
        lines.append(f"{symbol(name)} ::= " + " | ".join(" ".join(symbol(s) for s in alt) for alt in alternatives))
    for name, (_, gbnf) in TERMINALS.items():
        lines.append(f"{symbol(name)} ::= {gbnf}")
    return "\n".join(lines) + "\n"


# --- what the typed form can cost ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GrammarBounds:
    """The most any string of ``typed_program`` at ``depth`` can ask of the checker, at ``REFERENCE_DIMS`` (stage 0's
    shape), each an upper bound read off the rules (common subexpressions, which the checker merges, only lower
    them): predicted ``time_ns`` of a call, ``operations`` (graph nodes that compute), expression ``nesting`` (the
    checker's depth), ``parentheses`` open at once (Python's parser stops at 200), float32 ``peak_bytes`` live at once
    and the ``largest_tensor`` in bytes; ``witness`` is a string that reaches the time bound but for merging."""

    depth: int
    time_ns: float
    operations: int
    nesting: int
    parentheses: int
    peak_bytes: int
    largest_tensor: int
    witness: str


def _elements(kind: str, dims: dict[str, int]) -> int:
    shape = _TYPES.get(kind, ops.SCALAR)
    out = 1
    for d in shape:
        out *= dims[d]
    return out if kind in _TYPES else 0


def _op_time(op: _Op, dims: dict[str, int]) -> float:
    inputs = [Node("feature", f"x{i}", (), _TYPES.get(t, ops.SCALAR), 0) for i, t in enumerate(op.args)]
    node = Node(op.kind, op.name, tuple(range(len(inputs))), _TYPES[op.out], 0, literals=op.literals)
    return node_time_ns(TypedGraph(nodes=[*inputs, node]), len(inputs), dims)


def _op_scratch(op: _Op) -> float:
    return ops.FUNCTIONS[op.name].scratch if op.kind == "call" else 0.0


_WITNESS_TERMINALS = {"NUMBER": "2", "KERNEL": str(ops.KERNEL_RANGE[1]), "POWER": "3", "CHUNK": "1", "SINK": "0",
                      "FLOOR": "0"}


def bounds(depth: int = TYPED_DEPTH, dims: dict[str, int] | None = None) -> GrammarBounds:
    """The worst case of every checker budget over the strings of ``typed_program`` at ``depth`` (see
    :class:`GrammarBounds`), by one pass over the rules: each rule's worst is its worst alternative's, an
    alternative's the sum (or, for nesting, the most) of its sub-expressions' worst and its own operations'."""
    dims = dict(dims or REFERENCE_DIMS)
    rules = _alternatives(depth)
    worst: dict[str, tuple[float, int, int, int, int, str]] = {}  # time, ops, nesting, parens, peak, witness

    def of(symbol: str) -> tuple[float, int, int, int, int, str]:
        if symbol.startswith('"'):
            return 0.0, 0, 0, 0, 0, symbol[1:-1].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        if symbol in TERMINALS:
            return 0.0, 0, 0, 0, 0, _WITNESS_TERMINALS[symbol]
        if symbol not in worst:  # each bound its own maximum over the alternatives; the witness the slowest one's
            found = [alternative(alt) for alt in rules[symbol]]
            slowest = max(found, key=lambda w: (w[0], w[1]))
            worst[symbol] = (slowest[0], *(max(w[i] for w in found) for i in range(1, 5)), slowest[5])
        return worst[symbol]

    def alternative(alt: _Alt) -> tuple[float, int, int, int, int, str]:
        parts = [of(s) for s in alt.symbols]
        children = [(s, p) for s, p in zip(alt.symbols, parts) if not s.startswith('"') and s not in TERMINALS]
        time = sum(p[0] for p in parts) + sum(_op_time(op, dims) for op in alt.ops)
        count = sum(p[1] for p in parts) + len(alt.ops)
        nesting = len(alt.ops) + max((p[2] for _, p in children), default=0)
        parens = sum(s.count("(") for s in alt.symbols if s.startswith('"')) + max((p[3] for p in parts), default=0)
        held, peak = 0, 0
        for symbol, part in children:  # evaluated in order, each held until this alternative's operations ran
            peak = max(peak, held + part[4])
            held += _elements(symbol.rsplit("_", 1)[0], dims) * BYTES_PER_ELEMENT
        made = sum(_elements(op.out, dims) for op in alt.ops) * BYTES_PER_ELEMENT
        scratch = max((_op_scratch(op) * _elements(op.out, dims) for op in alt.ops), default=0) * BYTES_PER_ELEMENT
        peak = max(peak, held + made + int(scratch))
        return time, count, nesting, parens, peak, "".join(p[5] for p in parts)

    time, count, nesting, parens, peak, witness = of("typed_program")
    return GrammarBounds(depth, CALL_OVERHEAD_NS + time, count, nesting, parens, peak,
                         max(_elements(t, dims) for t in _TYPES) * BYTES_PER_ELEMENT, witness)


# --- random strings ------------------------------------------------------------------------------------------

def number_text(rng: random.Random) -> str:
    """A random string of the ``NUMBER`` terminal (a positive literal)."""
    whole = rng.choice(["0", str(rng.randint(1, 9)), str(rng.randint(10, 999))])
    if whole == "0":
        return f"0.{rng.randint(1, 999):03d}".rstrip("0") if rng.random() < 0.5 else f"0.{rng.randint(1, 9)}"
    return whole if rng.random() < 0.5 else f"{whole}.{rng.randint(0, 99)}"


def _terminal(name: str, rng: random.Random, numbers: Callable[[random.Random], str] | None = None) -> str:
    if name == "NUMBER":
        return (numbers or number_text)(rng)
    if name == "KERNEL":
        return str(rng.randint(*ops.KERNEL_RANGE))
    if name == "POWER":
        return str(rng.choice(TYPED_POWERS))
    if name in _SELECTION_TERMINALS:
        return str(rng.randint(*SELECTION_RANGES[_SELECTION_TERMINALS[name]]))
    raise KeyError(name)


def sample(seed: int, max_depth: int = 99, depth: int = TYPED_DEPTH,
           numbers: Callable[[random.Random], str] | None = None) -> str:
    """A random string of ``typed_program`` at nesting ``depth``; past ``max_depth`` symbols down the derivation
    only the shallowest alternatives are chosen (features and numbers). ``numbers`` draws the text of each number
    literal in place of the grammar's ``NUMBER`` (the value-class fuzz of ``benchmarks/language_cost.py``: the
    strings are then not all the grammar's)."""
    rng, rules = random.Random(seed), typed_rules(depth)

    def expand(symbol: str, level: int) -> str:
        if symbol.startswith('"'):
            return symbol[1:-1].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        if symbol in TERMINALS:
            return _terminal(symbol, rng, numbers)
        alternatives = rules[symbol]
        if level >= max_depth:
            leaves = [alt for alt in alternatives if all(s.startswith('"') or s in TERMINALS for s in alt)]
            alternatives = leaves or [alt for alt in alternatives if len(alt) == 1] or alternatives
        return "".join(expand(s, level + 1) for s in rng.choice(alternatives))

    return expand("typed_program", 0)


def write(folder: str | Path) -> list[Path]:
    """Write ``policy.lark`` and ``policy.gbnf`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "policy.lark", folder / "policy.gbnf"]
    paths[0].write_text(lark_text(), encoding="utf-8")
    paths[1].write_text(gbnf_text(), encoding="utf-8")
    return paths


if __name__ == "__main__":
    for path in write(sys.argv[1] if len(sys.argv) > 1 else "docs/grammar"):
        print(path)
