"""Stage 0 of the cascade: an allowlist check of a candidate's syntax tree, before anything runs.

A program may contain only what the compact interface (``features.py``) offers: ``score(f)`` made of
assignments, ``if``, ``for`` over a literal ``range``, ``return`` and expressions calling the listed
helpers, builtins, ``torch`` functions and tensor methods. Everything else (imports, strings, dunders,
loops without a bound, closures, classes) is rejected with the line it is on. This is the first of
several layers: the program is then interpreted, never run as Python (``interpreter.py``), inside the
sandbox process (``sandbox.py``).
"""

from __future__ import annotations

import ast
import math

from kvsieve.language import program_features as feats
from kvsieve.language.program_source import ProgramError, parse_selection

__all__ = ["StaticCheckError", "check_source", "MAX_SOURCE_CHARS", "MAX_NODES", "MAX_INT", "MAX_LOOP_ITERATIONS"]

MAX_SOURCE_CHARS = 8000
MAX_NODES = 2000
MAX_DEPTH = 60
MAX_INT = 10**6
MAX_LOOP_ITERATIONS = 4096  # product over nested loops
# keyword arguments that write into, retype or move a tensor, or call back into Python (max(key=...))
REFUSED_KEYWORDS = frozenset({"out", "dtype", "device", "key", "layout", "pin_memory", "requires_grad",
                              "memory_format", "generator", "names"})

_EXPRESSIONS = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.Attribute, ast.Subscript,
                ast.Slice, ast.Tuple, ast.List, ast.Constant, ast.Name)
# Syntax only; contexts, operators and keywords are checked through their parents.
_LEAVES = (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


class StaticCheckError(ValueError):
    """A program outside the allowed subset (the message names the construct and its line)."""


def _fail(node: ast.AST | None, what: str) -> StaticCheckError:
    line = getattr(node, "lineno", None)
    return StaticCheckError(f"line {line}: {what}" if line else what)


def _globals() -> set[str]:
    return {"torch", *feats.HELPERS, *feats.SAFE_BUILTINS, *getattr(feats, "MATH_CONSTANTS", {})}


def check_source(source: str) -> None:
    """Raise :class:`StaticCheckError` unless ``source`` is a program in the allowed subset."""
    if not isinstance(source, str):
        raise StaticCheckError(f"source must be a str, got {type(source).__name__}")
    if len(source) > MAX_SOURCE_CHARS:
        raise StaticCheckError(f"source has {len(source)} characters, more than {MAX_SOURCE_CHARS}")
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise StaticCheckError(f"line {err.lineno}: syntax error: {err.msg}") from None
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, huge literals, deep nesting
        raise StaticCheckError(f"source cannot be parsed: {type(err).__name__}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise StaticCheckError(f"program has {nodes} syntax nodes, more than {MAX_NODES}")
    try:
        _check_module(tree, source)
    except RecursionError:
        raise StaticCheckError("program nests too deeply") from None


def _check_module(tree: ast.Module, source: str) -> None:
    body = list(tree.body)
    if body and _is_docstring(body[0]):
        body.pop(0)
    scores = selections = 0
    for node in body:
        if isinstance(node, ast.Assign) and [_name(t) for t in node.targets] == ["SELECTION"]:
            if not isinstance(node.value, ast.Dict):
                raise _fail(node, "SELECTION must be a literal dict")
            selections += 1
        elif isinstance(node, ast.FunctionDef) and node.name == "score":
            scores += 1
            _Scorer(node).check()
        else:
            raise _fail(node, f"{_describe(node)} is not allowed at the top level (only a docstring, "
                              "SELECTION = {...} and def score(f))")
    if selections > 1:
        raise StaticCheckError("SELECTION is assigned more than once")
    if scores != 1:
        raise StaticCheckError(f"the program must define score(f) exactly once, found {scores}")
    try:
        parse_selection(source)
    except ProgramError as err:
        raise StaticCheckError(f"SELECTION: {err}") from None


class _Scorer:
    """Walks ``def score(f)`` in source order, tracking which local names are bound so far."""

    def __init__(self, fn: ast.FunctionDef) -> None:
        self.fn = fn
        self.reserved = _globals()
        self.param = ""
        self.bound: set[str] = set()
        self.loop_budget = 1
        self.depth = 0

    def check(self) -> None:
        fn, args = self.fn, self.fn.args
        if fn.decorator_list or fn.returns or getattr(fn, "type_params", None):
            raise _fail(fn, "score must have no decorators, annotations or type parameters")
        if (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults
                or len(args.args) != 1 or args.args[0].annotation):
            raise _fail(fn, "score must take exactly one plain parameter: def score(f)")
        self.param = args.args[0].arg
        self._check_identifier(fn, self.param)
        if self.param in self.reserved:
            raise _fail(fn, f"parameter name {self.param!r} shadows an allowed global")
        body = list(fn.body)
        if body and _is_docstring(body[0]) and len(body) > 1:
            body.pop(0)
        self._block(body)

    # --- statements ---------------------------------------------------------------------------------

    def _block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self._stmt(stmt)

    def _stmt(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            self._expr(node.value)
            for target in node.targets:
                self._bind(target)
        elif isinstance(node, ast.AugAssign):
            if not isinstance(node.target, ast.Name):
                raise _fail(node, "augmented assignment only to a plain local name")
            self._load_name(node.target)
            self._bind(node.target)
            self._expr(node.value)
            if isinstance(node.op, ast.MatMult):
                raise _fail(node, "matrix multiplication (@) is not allowed")
            if isinstance(node.op, (ast.Pow, ast.LShift, ast.RShift)) and _constant_number(node.value) is None:
                raise _fail(node, "a power or shift by a computed amount is not allowed")
        elif isinstance(node, ast.Return):
            if node.value is None:
                raise _fail(node, "return needs a value (the scores)")
            self._expr(node.value)
        elif isinstance(node, ast.If):
            self._expr(node.test)
            self._block(node.body)
            self._block(node.orelse)
        elif isinstance(node, ast.For):
            self._for(node)
        elif isinstance(node, (ast.Pass, ast.Break, ast.Continue)):
            pass
        else:
            raise _fail(node, f"{_describe(node)} is not allowed inside score")

    def _for(self, node: ast.For) -> None:
        if node.orelse or getattr(node, "type_comment", None):
            raise _fail(node, "for ... else is not allowed")
        it = node.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                and 1 <= len(it.args) <= 3 and not it.keywords):
            raise _fail(node, "for loops may only run over range(...) with literal int arguments")
        bounds = [_constant_number(arg) for arg in it.args]
        if any(isinstance(b, bool) or not isinstance(b, int) for b in bounds):
            raise _fail(node, "range(...) arguments must be literal ints")
        if len(bounds) == 3 and bounds[2] == 0:
            raise _fail(node, "range step must not be 0")
        count = len(range(*bounds))
        saved = self.loop_budget
        self.loop_budget *= max(count, 1)
        if self.loop_budget > MAX_LOOP_ITERATIONS:
            raise _fail(node, f"loops run more than {MAX_LOOP_ITERATIONS} iterations in total")
        self._bind(node.target)
        self._block(node.body)
        self.loop_budget = saved

    def _bind(self, target: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._bind(elt)
        elif isinstance(target, ast.Name):
            self._check_identifier(target, target.id)
            if target.id in self.reserved or target.id == self.param:
                raise _fail(target, f"assigning to {target.id!r} (an allowed global or the parameter) is not allowed")
            self.bound.add(target.id)
        else:
            raise _fail(target, f"assignment to {_describe(target)} is not allowed (only to local names)")

    # --- expressions --------------------------------------------------------------------------------

    def _expr(self, node: ast.expr) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail(node, "expression nests too deeply")
        try:
            self._expr_inner(node)
        finally:
            self.depth -= 1

    def _expr_inner(self, node: ast.expr) -> None:
        if not isinstance(node, _EXPRESSIONS):
            raise _fail(node, f"{_describe(node)} is not allowed")
        if isinstance(node, ast.Constant):
            _check_constant(node)
            return
        if isinstance(node, ast.Name):
            self._load_name(node)
            return
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            folded = _constant_number(node)  # e.g. 10 ** 10 is as large as the literal
            if isinstance(folded, int) and abs(folded) > MAX_INT:
                raise _fail(node, f"integer constant above {MAX_INT}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                raise _fail(node, "matrix multiplication (@) is not allowed")
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift, ast.RShift)) \
                    and _constant_number(node.right) is None:
                raise _fail(node, "a power or shift by a computed amount is not allowed (the right-hand side "
                                  "must be a literal number)")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and any(
                    isinstance(side, (ast.List, ast.Tuple)) for side in (node.left, node.right)):
                raise _fail(node, "sequence repetition ([...] * n) is not allowed")
        if isinstance(node, ast.Call):
            self._call(node)
            return
        if isinstance(node, ast.Attribute):
            self._attribute(node, call=False)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self._expr(child)
            elif not isinstance(child, _LEAVES):
                raise _fail(node, f"{_describe(child)} is not allowed")

    def _load_name(self, node: ast.Name) -> None:
        self._check_identifier(node, node.id)
        if node.id == "torch":
            raise _fail(node, "torch may only be used as torch.NAME(...)")
        if node.id not in self.bound and node.id != self.param and node.id not in self.reserved:
            raise _fail(node, f"name {node.id!r} is not defined before use (or not allowed)")

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            allowed = {*feats.HELPERS, *feats.SAFE_BUILTINS}
            if func.id not in allowed:
                raise _fail(node, f"call to {func.id!r} is not allowed")
            self._check_identifier(func, func.id)
        elif isinstance(func, ast.Attribute):
            self._attribute(func, call=True)
        else:
            raise _fail(node, f"calling {_describe(func)} is not allowed (call a name or a method)")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise _fail(arg, "*args in calls are not allowed")
            self._expr(arg)
        for kw in node.keywords:
            if kw.arg is None:
                raise _fail(kw, "**kwargs in calls are not allowed")
            self._check_identifier(kw, kw.arg)
            if kw.arg in REFUSED_KEYWORDS:
                raise _fail(kw, f"the keyword argument {kw.arg}= is not allowed")
            self._expr(kw.value)

    def _attribute(self, node: ast.Attribute, call: bool) -> None:
        self._check_identifier(node, node.attr)
        value = node.value
        if isinstance(value, ast.Name) and value.id == "torch":
            if node.attr not in feats.TORCH_FUNCTIONS:
                raise _fail(node, f"torch.{node.attr} is not allowed")
            if not call:
                raise _fail(node, f"torch.{node.attr} may only be called")
            return
        if isinstance(value, ast.Name) and value.id == self.param:
            fields = (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS)
            if node.attr not in fields or call:
                raise _fail(node, f"{self.param}.{node.attr} is not a field of the features")
            return
        if node.attr not in feats.TENSOR_METHODS:
            raise _fail(node, f"attribute or method .{node.attr} is not allowed")
        self._expr(value)

    def _check_identifier(self, node: ast.AST, name: str) -> None:
        if name.startswith("_"):
            raise _fail(node, f"names and attributes starting with '_' are not allowed ({name!r})")


def _check_constant(node: ast.Constant) -> None:
    value = node.value
    if value is None or value is Ellipsis or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise _fail(node, f"integer constant above {MAX_INT}")
        return
    if isinstance(value, float):
        return
    raise _fail(node, f"{type(value).__name__} constants are not allowed")


def _constant_number(node: ast.expr) -> int | float | None:
    """Value of a constant arithmetic expression (``-3``, ``10 ** 10``), ``None`` if it is not one."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _constant_number(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.BinOp):
        left, right = _constant_number(node.left), _constant_number(node.right)
        if left is None or right is None:
            return None
        try:
            if isinstance(node.op, ast.Pow):
                if abs(right) > 64 or (isinstance(left, int) and isinstance(right, int)
                                       and abs(left) > 1 and right * math.log2(abs(left)) > 64):
                    raise _fail(node, "constant power too large")
                return left**right
            if isinstance(node.op, ast.LShift):
                if not isinstance(right, int) or right > 64:
                    raise _fail(node, "constant shift too large")
                return left << right
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
            op = ops.get(type(node.op))
            return op(left, right) if op else None
        except (OverflowError, ZeroDivisionError, TypeError, ValueError):
            return None
    return None


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _describe(node: ast.AST) -> str:
    names = {ast.Import: "import", ast.ImportFrom: "from ... import", ast.While: "while loop", ast.Lambda: "lambda",
             ast.ClassDef: "class definition", ast.FunctionDef: "function definition (other than score)",
             ast.AsyncFunctionDef: "async function", ast.With: "with statement", ast.Try: "try statement",
             ast.Delete: "del statement", ast.Global: "global statement", ast.Nonlocal: "nonlocal statement",
             ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Await: "await", ast.JoinedStr: "f-string",
             ast.ListComp: "list comprehension", ast.GeneratorExp: "generator expression", ast.Raise: "raise",
             ast.Assert: "assert", ast.NamedExpr: "assignment expression (:=)", ast.Starred: "starred expression",
             ast.Dict: "dict display", ast.Set: "set display", ast.Expr: "bare expression statement",
             ast.AnnAssign: "annotated assignment", ast.Subscript: "subscript", ast.Attribute: "attribute",
             ast.Assign: "assignment (other than SELECTION = {...})", ast.AugAssign: "augmented assignment"}
    return names.get(type(node), type(node).__name__)
