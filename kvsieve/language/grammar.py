"""The language's grammar, generated from the operations table, for constrained decoding and for readers.

Two start rules share one set of terminals:

* ``program``: the syntax of every program (a docstring, ``SELECTION``, ``def score(f):`` with bindings and a
  return; comments and blank lines allowed). Names are untyped here: the checker (``typed_graph``) types them.
* ``typed_program``: one canonical form in which *every* string is a program the checker accepts: a SELECTION
  the selection accepts and a single returned expression typed by its shape family (``e3`` is (b, h, n),
  ``e4`` (b, h, g, n), ``e1`` (n)); literals are positive (a division by a literal cannot be by zero) and
  numbers only scale or shift tensors. This is what an LLM mutator decodes under.

:func:`lark_text` renders them for Lark, :func:`decoding_lark` the typed one for llguidance (what the
constrained mutator decodes under), :func:`gbnf_text` the typed one for xgrammar / llama.cpp (GBNF);
:func:`sample` draws random strings of ``typed_program`` (the tests check each one passes stage 0).
The files in ``docs/grammar/`` are these texts (``python -m kvsieve.language.grammar docs/grammar``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from kvsieve.language import operations as ops
from kvsieve.language.program_source import SELECTION_CHOICES, SELECTION_RANGES

__all__ = ["typed_rules", "lark_text", "decoding_lark", "gbnf_text", "sample", "TERMINALS"]

# terminal -> (Lark regex, GBNF expression)
TERMINALS: dict[str, tuple[str, str]] = {
    "NUMBER": (r"/(?:[1-9][0-9]{0,5}(?:\.[0-9]{1,4})?|0\.[0-9]{0,3}[1-9])/",
               r'[1-9] [0-9]{0,5} ("." [0-9]{1,4})? | "0." [0-9]{0,3} [1-9]'),
    "KERNEL": (r"/(?:25[0-7]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[1-9])/",
               r'"25" [0-7] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [1-9]'),
    "EXPONENT": (r"/-?[1-4]/", r'"-"? [1-4]'),
    "CHUNK": (r"/(?:6[0-4]|[1-5][0-9]|[1-9])/", r'"6" [0-4] | [1-5] [0-9] | [1-9]'),
    "SINK": (r"/(?:6[0-4]|[1-5][0-9]|[0-9])/", r'"6" [0-4] | [1-5] [0-9] | [0-9]'),
    "FLOOR": (r"/(?:50|[1-4][0-9]|[0-9])/", r'"50" | [1-4] [0-9] | [0-9]'),
}

# the terminals that spell a SELECTION int, and its key in SELECTION_RANGES
_SELECTION_TERMINALS = {"CHUNK": "chunk_size", "SINK": "sink", "FLOOR": "floor"}
_TYPES = {"e1": ops.N, "e3": ops.BHN, "e4": ops.BHGN}
_OF_SHAPE = {shape: name for name, shape in _TYPES.items()}
# what may be combined with a value of each type and keep it: itself, smaller tensor families, numbers
_PARTNERS = {"e1": ("e1",), "e3": ("e3", "e1"), "e4": ("e4", "e1")}
_SCALAR_FIELDS = [name for name, shape in ops.FEATURE_TYPES.items() if shape == ops.SCALAR]


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _calls(result: str) -> list[list[str]]:
    """The call alternatives whose result has type ``result``, read off the operations table."""
    alternatives = []
    for op in ops.FUNCTIONS.values():
        for arg_type, arg_shape in _TYPES.items():
            try:
                shapes = [arg_shape] * op.tensors
                out = op.result(*shapes)
            except ops.TypeRefusal:
                continue
            if _OF_SHAPE.get(out) != result:
                continue
            literals = []
            for i, kind in enumerate(op.literals):
                literals += ['", "', "KERNEL" if kind == "kernel" else ("NUMBER" if i else "NEG_NUMBER")]
            args = [arg_type] if op.tensors == 1 else [arg_type, '", "', arg_type]
            alternatives.append([_q(op.name + "("), *args, *literals, '")"'])
    return alternatives


def typed_rules(depth: int | None = None) -> dict[str, list[list[str]]]:
    """``typed_program``'s rules: name -> alternatives, each a list of symbols (a quoted literal, a terminal or a
    rule name). A binary operation joins a value of the rule's type with a partner on either side. ``depth``
    bounds the nesting (rules ``e3_0`` .. ``e3_D``, level 0 only features), so every derivation ends: what a
    small or random model decodes under, whatever it prefers."""
    def allocated(allocation: str, *tail: str) -> list[str]:  # chunks of 1, sinks, an allocation, a normalisation
        return ['"SELECTION = {\\"chunk_size\\": 1, \\"sink\\": "', "SINK", '", \\"allocation\\": "', allocation,
                '", \\"normalization\\": "', "NORMALIZATION", *tail, '"}\\n"']

    selection_alternatives = [
        allocated("ALLOCATION"),
        ['"SELECTION = {\\"chunk_size\\": "', "CHUNK", '", \\"sink\\": "', "SINK", '"}\\n"'],
        # a floor only where budgets move between heads (the selection refuses it under "uniform")
        allocated("MOVING", '", \\"floor\\": "', "FLOOR"),
    ]
    top = "e3" if depth is None else f"e3_{depth}"
    rules: dict[str, list[list[str]]] = {
        "typed_program": [['"\\"\\"\\"Evolved policy.\\"\\"\\"\\n"', "selection",
                           '"\\ndef score(f):\\n    return "', top, '"\\n"']],
        "selection": selection_alternatives,
        "ALLOCATION": [[_q(_q(choice))] for choice in SELECTION_CHOICES["allocation"]],
        "MOVING": [[_q(_q(choice))] for choice in SELECTION_CHOICES["allocation"] if choice != "uniform"],
        "NORMALIZATION": [[_q(_q(choice))] for choice in SELECTION_CHOICES["normalization"]],
        "scalar": [["NUMBER"], *([_q(f"f.{name}")] for name in _SCALAR_FIELDS)],
        "NEG_NUMBER": [["NUMBER"], ['"-"', "NUMBER"]],
    }
    levels = [None] if depth is None else list(range(depth + 1))
    for level in levels:
        def at(name: str, level: int | None = level) -> str:  # the rule a sub-expression one level down
            return name if level is None or name not in _TYPES else f"{name}_{level - 1}"

        for name, shape in _TYPES.items():
            leaves = [[_q(f"f.{field}")] for field, fshape in ops.FEATURE_TYPES.items() if fshape == shape]
            alternatives = list(leaves)
            if level != 0:
                alternatives += [[at(sym) for sym in alt] for alt in _calls(name)]
                alternatives += [['"("', at(name), '" ** "', "EXPONENT", '")"']]
                for symbol in ops.BINARY_OPERATORS:
                    for partner in (*_PARTNERS[name], "scalar"):
                        alternatives.append(['"("', at(name), _q(f" {symbol} "), at(partner), '")"'])
                        if partner != name:
                            alternatives.append(['"("', at(partner), _q(f" {symbol} "), at(name), '")"'])
            if level is not None and level > 0:
                alternatives.append([at(name)])  # a shallower expression is one too
            rules[name if level is None else f"{name}_{level}"] = alternatives
    return rules


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
        "LITERAL: /[0-9]+(\\.[0-9]*)?([eE][-+]?[0-9]+)?/ | /\\.[0-9]+([eE][-+]?[0-9]+)?/",
        "SIGNED: /-?[0-9]+/",
        "INT: /[0-9]+/",
        "NAME: /[A-Za-z_][A-Za-z_0-9]*/",
        "STRING: /\"[^\"\\n]*\"|'[^'\\n]*'/",
        'DOCSTRING: /"""(.|\\n)*?"""/',
        "_NL: /\\r?\\n/",
        "%ignore /[ \\t]+/",
        "%ignore /#[^\\n]*/",
    ])


def lark_text() -> str:
    """Both start rules for Lark: ``Lark(lark_text(), start="program" | "typed_program", parser="earley")``."""
    lines = ["// kvsieve policy programs, generated from kvsieve/language/operations.py by kvsieve.language.grammar",
             "// start rules: program (the syntax of any program), typed_program (every string a checked program)",
             "", _syntax_grammar(), ""]
    for name, alternatives in typed_rules().items():
        if name.isupper():  # a terminal made of choices
            lines.append(f"{name}: " + " | ".join(" ".join(alt) for alt in alternatives))
        else:
            lines.append(f"{name}: " + "\n    | ".join(" ".join(alt) for alt in alternatives))
    for name, (regex, _) in TERMINALS.items():
        lines.append(f"{name}: {regex}")
    return "\n".join(lines) + "\n"


DECODING_DEPTH = 4  # nesting of the constrained mutator's programs (the kept programs nest 3 to 4 deep)


def decoding_lark(fenced: bool = True, depth: int = DECODING_DEPTH) -> str:
    """``typed_program`` with its nesting bounded by ``depth``, as a Lark grammar for llguidance (start rule
    ``start``); ``fenced`` wraps it in a ```python block, the reply format the LLM mutators ask for."""
    start = '"```python\\n" typed_program "```"' if fenced else "typed_program"
    lines = [f"start: {start}"]
    for name, alternatives in typed_rules(depth).items():
        lines.append(f"{name}: " + " | ".join(" ".join(alt) for alt in alternatives))
    for name, (regex, _) in TERMINALS.items():
        lines.append(f"{name}: {regex}")
    return "\n".join(lines) + "\n"


def gbnf_text() -> str:
    """``typed_program`` as GBNF (root = typed_program), for xgrammar or llama.cpp."""
    lines = ["# kvsieve typed policy programs, generated by kvsieve.language.grammar from operations.py",
             "root ::= typed-program"]

    def symbol(s: str) -> str:
        return s if s.startswith('"') else s.lower().replace("_", "-")

    for name, alternatives in typed_rules().items():
        lines.append(f"{symbol(name)} ::= " + " | ".join(" ".join(symbol(s) for s in alt) for alt in alternatives))
    for name, (_, gbnf) in TERMINALS.items():
        lines.append(f"{symbol(name)} ::= {gbnf}")
    return "\n".join(lines) + "\n"


def _terminal(name: str, rng: random.Random) -> str:
    if name == "NUMBER":
        whole = rng.choice(["0", str(rng.randint(1, 9)), str(rng.randint(10, 999))])
        if whole == "0":
            return f"0.{rng.randint(1, 999):03d}".rstrip("0") if rng.random() < 0.5 else f"0.{rng.randint(1, 9)}"
        return whole if rng.random() < 0.5 else f"{whole}.{rng.randint(0, 99)}"
    if name == "KERNEL":
        return str(rng.randint(*ops.KERNEL_RANGE))
    if name == "EXPONENT":
        return str(rng.choice([-1, 1]) * rng.randint(1, ops.POW_RANGE[1]))
    if name in _SELECTION_TERMINALS:
        return str(rng.randint(*SELECTION_RANGES[_SELECTION_TERMINALS[name]]))
    raise KeyError(name)


def sample(seed: int, max_depth: int = 6, depth: int | None = None) -> str:
    """A random string of ``typed_program`` (of nesting at most ``depth`` if given, the decoding grammar's form);
    past ``max_depth`` only features and numbers are chosen."""
    rng, rules = random.Random(seed), typed_rules(depth)

    def expand(symbol: str, depth: int) -> str:
        if symbol.startswith('"'):
            return symbol[1:-1].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        if symbol in TERMINALS:
            return _terminal(symbol, rng)
        alternatives = rules[symbol]
        if depth >= max_depth:
            leaves = [alt for alt in alternatives if all(s.startswith('"') or s in TERMINALS for s in alt)]
            alternatives = leaves or [alt for alt in alternatives if "scalar" not in alt][:1] or alternatives
        return "".join(expand(s, depth + 1) for s in rng.choice(alternatives))

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
