"""A program's text -> a typed graph: every node's operation, inputs and symbolic shape, before anything runs.

The surface is Python syntax, read with :mod:`ast` and never compiled::

    \"\"\"What it does.\"\"\"
    SELECTION = {"chunk_size": 1, "sink": 0}

    def score(f):
        local = group_mean(f.attn)
        return 0.5 * unit_mean(local) + pool(local, 9)

``score(f)`` is named bindings (``name = expr``) and one final ``return expr``. An expression is a feature
(``f.attn``), a number literal, ``+ - * /``, unary ``-``, ``x ** k`` (an int literal ``k``), a bound name, or
a call of an operation of :mod:`kvsieve.language.operations` with its typed arguments. Nothing else parses:
no loops, conditionals, comparisons, tuples, indexing, methods, keywords, augmented assignment or attribute
access beyond ``f.<feature>``. Numbers combined with numbers are folded here, within bounds; the result of
``score`` must be shaped (b, h, n). Common subexpressions are one node. Every refusal is a
:class:`ProgramRefused` naming the line.
"""

from __future__ import annotations

import ast
import math
import warnings
from dataclasses import dataclass, field

from kvsieve.language import operations as ops
from kvsieve.language.program_source import ProgramError, parse_selection, value_text

__all__ = ["Node", "TypedGraph", "ProgramRefused", "build_graph", "MAX_SOURCE_CHARS", "MAX_OPERATIONS",
           "MAX_DEPTH", "MAX_BINDINGS"]

MAX_SOURCE_CHARS = 8000
MAX_OPERATIONS = 256  # graph nodes that compute (features and literals not counted)
MAX_DEPTH = 128  # nesting of one expression (a sum of k terms nests k - 1 deep)
MAX_BINDINGS = 64


class ProgramRefused(ValueError):
    """Text that is not a program of the language (the message names the construct and its line)."""


@dataclass(frozen=True)
class Node:
    """One value of the program. ``kind``: "feature" (``name`` is the field), "literal" (``value``), "call"
    (``name`` an operation of ``operations.FUNCTIONS``, ``literals`` its literal arguments), "binary" (``name``
    one of + - * /), "neg" or "pow" (``literals`` = (k,)). ``inputs`` are node indices."""

    kind: str
    name: str
    inputs: tuple[int, ...]
    shape: ops.Dims
    line: int
    value: float = 0.0
    literals: tuple = ()

    @property
    def key(self) -> tuple:
        return (self.kind, self.name, self.inputs, self.value if self.kind == "literal" else 0.0, self.literals)

    @property
    def is_tensor(self) -> bool:
        return self.shape != ops.SCALAR

    @property
    def computes(self) -> bool:
        return self.kind not in ("feature", "literal")


@dataclass
class TypedGraph:
    """The nodes in evaluation order (every input before its user), the returned node and the fields read."""

    nodes: list[Node] = field(default_factory=list)
    output: int = -1
    filename: str = "<program>"

    @property
    def fields(self) -> set[str]:
        return {n.name for n in self.nodes if n.kind == "feature"}

    @property
    def operations(self) -> int:
        return sum(1 for n in self.nodes if n.computes)

    def live_nodes(self) -> list[int]:
        """Indices of the nodes the output depends on, in evaluation order."""
        needed = {self.output}
        for index in range(self.output, -1, -1):
            if index in needed:
                needed.update(self.nodes[index].inputs)
        return sorted(needed)


def build_graph(source: str, filename: str = "<program>") -> TypedGraph:
    """Parse, type and fold ``source``; raise :class:`ProgramRefused` (naming ``filename`` and the line)."""
    if not isinstance(source, str):
        raise ProgramRefused(f"{filename}: source must be a str, got {type(source).__name__}")
    if len(source) > MAX_SOURCE_CHARS:
        raise ProgramRefused(f"{filename}: source has {len(source)} characters, more than {MAX_SOURCE_CHARS}")
    try:
        with warnings.catch_warnings():  # a candidate's text is data: its SyntaxWarnings are not the user's
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except SyntaxError as err:
        line = err.lineno if err.lineno is not None else _unparsable_line(source)
        raise ProgramRefused(f"{filename} line {line}: syntax error: {err.msg}") from None
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, deep nesting
        raise ProgramRefused(f"{filename} line {_unparsable_line(source)}: source cannot be parsed: "
                             f"{type(err).__name__}") from None
    try:
        return _Builder(filename).module(tree, source)
    except ProgramRefused:
        raise
    except RecursionError:
        raise ProgramRefused(f"{filename}: the program nests too deeply") from None
    except Exception as err:  # noqa: BLE001 - whatever the text makes the reader raise, it is the text's refusal
        raise ProgramRefused(f"{filename}: the program cannot be read: {type(err).__name__}") from None


def _unparsable_line(source: str) -> int:
    """The line Python's parser gave up on when it names none: the first null byte's, else the longest line (where
    a nesting too deep to parse is)."""
    if "\0" in source:
        return source.count("\n", 0, source.index("\0")) + 1
    lines = source.split("\n")
    return max(range(len(lines)), key=lambda i: len(lines[i])) + 1


def _short(node: ast.AST, limit: int = 60) -> str:
    """The source of ``node``, cut to ``limit`` characters (an error never echoes a whole hostile line)."""
    try:
        text = ast.unparse(node)
    except (ValueError, RecursionError, MemoryError):  # an int of more than 4300 digits, deep nesting
        return f"a {_describe(node)}"
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _describe(node: ast.AST) -> str:
    names = {ast.For: "a for loop", ast.While: "a while loop", ast.If: "an if statement", ast.IfExp: "a conditional",
             ast.AugAssign: "augmented assignment (x += y)", ast.Subscript: "indexing", ast.Tuple: "a tuple",
             ast.List: "a list", ast.Compare: "a comparison", ast.BoolOp: "and/or", ast.Lambda: "a lambda",
             ast.ListComp: "a comprehension", ast.GeneratorExp: "a comprehension", ast.Import: "an import",
             ast.ImportFrom: "an import", ast.Expr: "an expression statement", ast.Dict: "a dict",
             ast.JoinedStr: "an f-string", ast.Starred: "unpacking", ast.NamedExpr: "the := operator"}
    return names.get(type(node), type(node).__name__)


class _Builder:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.graph = TypedGraph(filename=filename)
        self.index: dict[tuple, int] = {}
        self.bound: dict[str, int] = {}
        self.param = "f"

    def refuse(self, node: ast.AST | None, what: str) -> ProgramRefused:
        line = getattr(node, "lineno", None)
        return ProgramRefused(f"{self.filename} line {line}: {what}" if line else f"{self.filename}: {what}")

    # --- the module ----------------------------------------------------------------------------------

    def module(self, tree: ast.Module, source: str) -> TypedGraph:
        body = list(tree.body)
        if body and _is_docstring(body[0]):
            body.pop(0)
        scores, selections = [], []
        for node in body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["SELECTION"]:
                if not isinstance(node.value, ast.Dict):
                    raise self.refuse(node, "SELECTION must be a literal dict")
                selections.append(node)
            elif isinstance(node, ast.FunctionDef) and node.name == "score":
                scores.append(node)
            else:
                raise self.refuse(node, f"{_describe(node)} is not allowed at the top level (only a docstring, "
                                        "SELECTION = {...} and def score(f))")
        if len(selections) > 1:
            raise self.refuse(selections[1], "SELECTION is assigned more than once")
        if len(scores) != 1:
            raise self.refuse(scores[1] if scores else None,
                              f"the program must define score(f) exactly once, found {len(scores)}")
        try:
            parse_selection(source)
        except ProgramError as err:
            raise self.refuse(selections[0] if selections else None, f"SELECTION: {err}") from None
        self.function(scores[0])
        return self.graph

    def function(self, fn: ast.FunctionDef) -> None:
        args = fn.args
        if fn.decorator_list or fn.returns or getattr(fn, "type_params", None):
            raise self.refuse(fn, "score must have no decorators, annotations or type parameters")
        if (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults
                or len(args.args) != 1 or args.args[0].annotation):
            raise self.refuse(fn, "score must take exactly one plain parameter: def score(f)")
        self.param = args.args[0].arg
        if self.param in ops.FUNCTIONS or self.param == "torch":
            raise self.refuse(fn, f"parameter name {self.param!r} shadows an operation")
        body = list(fn.body)
        if len(body) > 1 and _is_docstring(body[0]):
            body.pop(0)
        *bindings, last = body
        if not isinstance(last, ast.Return) or last.value is None:
            raise self.refuse(last, "score(f) must end with `return EXPRESSION`")
        if len(bindings) > MAX_BINDINGS:
            raise self.refuse(bindings[MAX_BINDINGS], f"more than {MAX_BINDINGS} bindings")
        for stmt in bindings:
            if isinstance(stmt, ast.Return):
                raise self.refuse(stmt, "return must be the last statement")
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                raise self.refuse(stmt, f"{_describe(stmt)} is not allowed; a statement is `name = expression`")
            name = stmt.targets[0].id
            if name in (self.param, "torch", *ops.FUNCTIONS):
                raise self.refuse(stmt, f"name {name!r} shadows the parameter or an operation")
            self.bound[name] = self.expr(stmt.value, 0)
        output = self.expr(last.value, 0)
        shape = self.graph.nodes[output].shape
        if shape != ops.BHN:
            raise self.refuse(last, f"score must return scores shaped (b, h, n), this returns {ops.shape_text(shape)}")
        self.graph.output = output
        if self.graph.operations > MAX_OPERATIONS:
            raise self.refuse(last, f"the program has {self.graph.operations} operations, more than {MAX_OPERATIONS}")

    # --- expressions ---------------------------------------------------------------------------------

    def add(self, node: Node) -> int:
        hit = self.index.get(node.key)
        if hit is not None:
            return hit
        self.graph.nodes.append(node)
        self.index[node.key] = len(self.graph.nodes) - 1
        if len(self.graph.nodes) > 4 * MAX_OPERATIONS:
            raise self.refuse(None, f"the program has more than {MAX_OPERATIONS} operations")
        return len(self.graph.nodes) - 1

    def literal(self, node: ast.AST, value: float) -> int:
        try:
            ops.check_number(value)
        except ops.TypeRefusal as err:
            raise self.refuse(node, str(err)) from None
        return self.add(Node("literal", "", (), ops.SCALAR, getattr(node, "lineno", 0), value=value))

    def expr(self, node: ast.expr, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise self.refuse(node, f"the expression nests deeper than {MAX_DEPTH}")
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.refuse(node, f"only number literals are allowed, got {type(value).__name__}")
            try:
                ops.check_literal("number", value)
            except ops.TypeRefusal as err:
                raise self.refuse(node, str(err)) from None
            return self.literal(node, value)
        if isinstance(node, ast.Name):
            if node.id in self.bound:
                return self.bound[node.id]
            if node.id == self.param:
                raise self.refuse(node, f"{self.param} is read only through its fields ({self.param}.attn, ...)")
            raise self.refuse(node, f"name {node.id!r} is not bound (a binding must come before its use)")
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == self.param:
                if node.attr not in ops.FEATURE_TYPES:
                    raise self.refuse(node, f"{self.param}.{node.attr} is not a feature; the features are "
                                            + ", ".join(ops.FEATURE_TYPES))
                return self.add(Node("feature", node.attr, (), ops.FEATURE_TYPES[node.attr], line))
            raise self.refuse(node, f"attribute access {_short(node)} is not allowed (only "
                                    f"{self.param}.<feature>; torch.NAME only as a call)")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = self.expr(node.operand, depth + 1)
            if isinstance(node.op, ast.UAdd):
                return inner
            arg = self.graph.nodes[inner]
            if arg.kind == "literal":
                return self.literal(node, -arg.value)
            return self.add(Node("neg", "-", (inner,), arg.shape, line))
        if isinstance(node, ast.BinOp):
            return self.binary(node, depth)
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        raise self.refuse(node, f"{_describe(node)} is not allowed")

    def binary(self, node: ast.BinOp, depth: int) -> int:
        line = node.lineno
        left = self.expr(node.left, depth + 1)
        if isinstance(node.op, ast.Pow):
            exponent = node.right
            sign = 1
            if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, ast.USub):
                exponent, sign = exponent.operand, -1
            k = exponent.value if isinstance(exponent, ast.Constant) else None
            try:
                k = ops.pow_literal(k if k is None or isinstance(k, bool) or not isinstance(k, int) else sign * k)
            except ops.TypeRefusal as err:
                raise self.refuse(node, str(err)) from None
            base = self.graph.nodes[left]
            if base.kind == "literal":
                return self.literal(node, self.fold(node, lambda: float(base.value) ** k))
            return self.add(Node("pow", "**", (left,), base.shape, line, literals=(k,)))
        symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}.get(type(node.op))
        if symbol is None:
            raise self.refuse(node, f"operator {type(node.op).__name__} is not allowed (only + - * / and ** k)")
        right = self.expr(node.right, depth + 1)
        a, b = self.graph.nodes[left], self.graph.nodes[right]
        if a.kind == "literal" and b.kind == "literal":
            fn = ops.BINARY_OPERATORS[symbol]
            return self.literal(node, self.fold(node, lambda: fn(float(a.value), float(b.value))))
        try:
            shape = ops.broadcast(a.shape, b.shape)
        except ops.TypeRefusal as err:
            raise self.refuse(node, f"{symbol}: {err}") from None
        return self.add(Node("binary", symbol, (left, right), shape, line))

    def fold(self, node: ast.AST, compute) -> float:
        try:
            value = compute()
        except (ZeroDivisionError, OverflowError) as err:
            raise self.refuse(node, f"the numbers cannot be combined: {err}") from None
        if isinstance(value, complex) or not math.isfinite(value):
            raise self.refuse(node, f"the numbers combine to {value_text(value)}, not a finite number")
        return value

    def call(self, node: ast.Call, depth: int) -> int:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ops.FUNCTIONS:
            name = func.id
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"
              and f"torch.{func.attr}" in ops.FUNCTIONS):
            name = f"torch.{func.attr}"
        else:
            allowed = ", ".join(ops.FUNCTIONS)
            raise self.refuse(node, f"{_short(func)} is not an operation of the language; the operations "
                                    f"are {allowed}")
        op = ops.FUNCTIONS[name]
        if node.keywords:
            raise self.refuse(node, f"{name} takes no keyword arguments")
        expected = op.tensors + len(op.literals)
        if len(node.args) != expected or any(isinstance(a, ast.Starred) for a in node.args):
            raise self.refuse(node, f"{name} takes {expected} argument{'s' if expected != 1 else ''}, "
                                    f"got {len(node.args)}")
        inputs = tuple(self.expr(arg, depth + 1) for arg in node.args[:op.tensors])
        literals = []
        for kind, arg in zip(op.literals, node.args[op.tensors:], strict=True):
            sign = 1
            if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and kind == "number":
                arg, sign = arg.operand, -1
            if not isinstance(arg, ast.Constant):
                raise self.refuse(arg, f"{name}: argument must be a number literal, got {_short(arg)}")
            try:
                value = ops.check_literal(kind, arg.value)
            except ops.TypeRefusal as err:
                raise self.refuse(arg, f"{name}: {err}") from None
            literals.append(sign * value)
        try:
            shape = op.result(*(self.graph.nodes[i].shape for i in inputs))
        except ops.TypeRefusal as err:
            raise self.refuse(node, f"{name} {err}") from None
        return self.add(Node("call", name, inputs, shape, node.lineno, literals=tuple(literals)))


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
