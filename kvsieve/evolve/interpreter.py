"""Candidates are data: an interpreter over a program's syntax tree, so no candidate code ever runs as Python.

A program (``program.py`` format) is parsed, never compiled. :class:`ScoreProgram` walks the body of
``def score(f)`` node by node; each node maps to one allowed operation from a fixed table (the
helpers, builtins, ``torch`` functions and tensor methods of ``features.py``), and before an
operation runs the interpreter checks what it would create against :class:`Limits`: elements of a
tensor (predicted from the operands' broadcast shape), bits of an integer, length of a sequence,
trips of a loop, the total element work and the number of operations, and a wall-clock deadline.
Python's ``getattr``, ``exec`` and ``compile`` are never called on anything from the candidate: a
name or attribute that is not in the tables does not exist for it.

The interpreter is an allowlist on its own (``static_check=False`` shows that in the tests): any
node it has no rule for is refused with the line it is on. By default the source first passes the
stage-0 check (``static.check_source``), so the two agree on what a program is.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass

import torch

from kvsieve.evolve import features as feats
from kvsieve.evolve.program import fields_read
from kvsieve.evolve.static import REFUSED_KEYWORDS, StaticCheckError, check_source

__all__ = ["Limits", "ScoreProgram", "InterpreterError", "LimitExceeded", "ProgramFailed", "REFUSED_KEYWORDS"]



class InterpreterError(ValueError):
    """The program asked for something the interpreter has no rule for (the message names it and its line)."""


class LimitExceeded(InterpreterError):
    """An operation would exceed one of the :class:`Limits` (checked before it runs)."""


class ProgramFailed(InterpreterError):
    """An allowed operation raised (wrong shapes, an index out of range): the program's own error."""


@dataclass(frozen=True)
class Limits:
    """What one call of ``score`` may create or spend.

    ``max_elements``: elements of any one tensor (16 M float32 = 64 MiB); ``max_work``: elements over
    all tensor operations of the call; ``max_ops``: syntax nodes evaluated; ``max_int_bits``: bits of
    any Python integer; ``max_sequence``: length of a tuple, list or range; ``deadline_s``: wall clock.
    """

    max_elements: int = 1 << 24
    max_work: int = 1 << 28
    max_ops: int = 1_000_000
    max_int_bits: int = 64
    max_sequence: int = 4096
    deadline_s: float | None = 60.0

    def __post_init__(self) -> None:
        for name in ("max_elements", "max_work", "max_ops", "max_int_bits", "max_sequence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"Limits.deadline_s must be > 0 or None, got {self.deadline_s!r}")


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Return(Exception):
    def __init__(self, value: object) -> None:
        self.value = value


class _Features:
    """What the parameter ``f`` is to a program: a name whose fields can be read, nothing else."""

    __slots__ = ("values",)

    def __init__(self, values: dict) -> None:
        self.values = values


class _Method:
    """``tensor.NAME`` before it is called (the only thing a program can do with it)."""

    __slots__ = ("target", "name")

    def __init__(self, target: torch.Tensor, name: str) -> None:
        self.target, self.name = target, name


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_VALUE_ATTRIBUTES = ("shape", "values", "indices")  # attributes read without a call
_SCALARS = (bool, int, float)
_TORCH = {name: getattr(torch, name) for name in feats.TORCH_FUNCTIONS}
_TENSOR_METHODS = frozenset(feats.TENSOR_METHODS) - set(_VALUE_ATTRIBUTES)
_NAMES = {**feats.HELPERS, **feats.MATH_CONSTANTS}
_BUILTINS = frozenset(feats.SAFE_BUILTINS)


def _literal_number(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


class ScoreProgram:
    """A program's ``score(f)`` as data; calling it on :class:`~kvsieve.evolve.features.Features` interprets it.

    ``static_check=False`` skips stage 0 (tests use it to show this layer holds alone); the
    interpreter then still refuses, at the node, whatever it has no rule for.
    """

    def __init__(self, source: str, limits: Limits = Limits(), static_check: bool = True,
                 filename: str = "<program>") -> None:
        if not isinstance(source, str):
            raise InterpreterError(f"{filename}: source must be a str, got {type(source).__name__}")
        self.filename, self.limits = filename, limits
        if static_check:
            try:
                check_source(source)
            except StaticCheckError as err:
                raise InterpreterError(f"{filename}: {err}") from None
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
            raise InterpreterError(f"{filename}: the source cannot be parsed: {type(err).__name__}") from None
        self._fn = self._find_score(tree)
        self._param = self._fn.args.args[0].arg

    @property
    def fields(self) -> set[str]:
        """The feature fields ``score`` reads."""
        return fields_read(self._fn, (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS), self._param)

    def _find_score(self, tree: ast.Module) -> ast.FunctionDef:
        found = None
        for index, node in enumerate(tree.body):
            if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["SELECTION"]:
                continue  # data, read by program.parse_selection with literal_eval; never evaluated here
            if isinstance(node, ast.FunctionDef) and node.name == "score" and found is None:
                args = node.args
                if (len(args.args) == 1 and not (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg
                                                 or args.defaults or node.decorator_list)):
                    found = node
                    continue
            raise self._refuse(node, f"{type(node).__name__} at the top level")
        if found is None:
            raise InterpreterError(f"{self.filename}: the program defines no score(f)")
        return found

    def _refuse(self, node: ast.AST | None, what: str, limit: bool = False, failed: bool = False
                ) -> InterpreterError:
        line = getattr(node, "lineno", None)
        where = f"{self.filename} line {line}" if line else self.filename
        if failed:
            return ProgramFailed(f"{where}: {what}")
        if limit:
            return LimitExceeded(f"{where}: limit: {what}")
        return InterpreterError(f"{where}: {what} is not allowed")

    # --- running -------------------------------------------------------------------------------------

    def __call__(self, features: feats.Features) -> object:
        run = _Run(self, features)
        try:
            run.block(self._fn.body)
        except _Return as ret:
            return ret.value
        except (_Break, _Continue):
            raise self._refuse(self._fn, "break or continue outside a loop") from None
        except RecursionError:
            raise self._refuse(self._fn, "nesting this deep", limit=True) from None
        raise self._refuse(self._fn, "score(f) returned nothing: a score function without return")


class _Run:
    """The state of one call: local names and what has been spent."""

    def __init__(self, program: ScoreProgram, features: feats.Features) -> None:
        self.p, self.limits = program, program.limits
        values = {name: getattr(features, name) for name in (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS)}
        self.locals: dict[str, object] = {program._param: _Features(values)}
        self.ops = self.work = 0
        deadline = self.limits.deadline_s
        self.deadline = None if deadline is None else time.monotonic() + deadline

    def tick(self, node: ast.AST) -> None:
        self.ops += 1
        if self.ops > self.limits.max_ops:
            raise self.p._refuse(node, f"more than {self.limits.max_ops} operations", limit=True)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise self.p._refuse(node, f"running longer than {self.limits.deadline_s:g} s", limit=True)

    # --- statements ---------------------------------------------------------------------------------

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt) -> None:
        self.tick(node)
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            for target in node.targets:
                self.bind(target, value)
        elif isinstance(node, ast.AugAssign):
            if not isinstance(node.target, ast.Name):
                raise self.p._refuse(node, "augmented assignment to anything but a local name")
            # x += y is x = x + y: never the in-place operator, so an input tensor cannot be written
            left = self.name(node.target)
            self.bind(node.target, self.binary(node, node.op, left, self.expr(node.value), node.value))
        elif isinstance(node, ast.Return):
            if node.value is None:
                raise self.p._refuse(node, "return without a value")
            raise _Return(self.expr(node.value))
        elif isinstance(node, ast.If):
            self.block(node.body if self.truth(node.test) else node.orelse)
        elif isinstance(node, ast.For):
            self.loop(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                               str):
            pass  # a docstring
        elif isinstance(node, ast.Pass):
            pass
        elif isinstance(node, ast.Break):
            raise _Break
        elif isinstance(node, ast.Continue):
            raise _Continue
        else:
            raise self.p._refuse(node, type(node).__name__)

    def loop(self, node: ast.For) -> None:
        it = node.iter
        if node.orelse or not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                               and not it.keywords and 1 <= len(it.args) <= 3
                               and all(isinstance(a, ast.Constant) and type(a.value) is int
                                       or isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub)
                                       and isinstance(a.operand, ast.Constant) and type(a.operand.value) is int
                                       for a in it.args)):
            raise self.p._refuse(node, "a for loop other than over range(...) of literal ints")
        trips = self.range_of(node, [self.expr(a) for a in it.args])
        for value in trips:
            self.tick(node)
            self.bind(node.target, value)
            try:
                self.block(node.body)
            except _Break:
                break
            except _Continue:
                continue

    def bind(self, target: ast.expr, value: object) -> None:
        if isinstance(target, ast.Name):
            name = target.id
            if name.startswith("_") or name == "torch" or name in _NAMES or name in _BUILTINS or name == self.p._param:
                raise self.p._refuse(target, f"assigning to {name!r}")
            self.locals[name] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            if not isinstance(value, (tuple, list)) or len(value) != len(target.elts):
                raise self.p._refuse(target, f"unpacking {_kind(value)} into {len(target.elts)} names")
            for elt, item in zip(target.elts, value, strict=True):
                self.bind(elt, item)
        else:
            raise self.p._refuse(target, f"assignment to {type(target).__name__}")

    # --- expressions --------------------------------------------------------------------------------

    def truth(self, node: ast.expr) -> bool:
        value = self.expr(node)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise self.p._refuse(node, f"the truth value of a tensor of {value.numel()} elements")
        if not isinstance(value, (*_SCALARS, torch.Tensor, type(None), tuple, list)):
            raise self.p._refuse(node, f"the truth value of {_kind(value)}")
        return bool(value)

    def expr(self, node: ast.expr) -> object:
        self.tick(node)
        method = _EXPRESSIONS.get(type(node))
        if method is None:
            raise self.p._refuse(node, _describe(node))
        try:
            value = method(self, node)
        except (InterpreterError, _Break, _Continue, _Return):
            raise
        except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError) as err:
            raise self.p._refuse(node, f"{type(err).__name__}: {_first_line(err)}", failed=True) from None
        return self.checked(node, value)

    def checked(self, node: ast.AST, value: object) -> object:
        """Every value an operation made, checked once more after the fact (the prediction is the guard)."""
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            if value.bit_length() > self.limits.max_int_bits:
                raise self.p._refuse(node, f"an integer above {self.limits.max_int_bits} bits", limit=True)
        elif isinstance(value, torch.Tensor):
            if value.numel() > self.limits.max_elements:
                raise self.p._refuse(node, f"a tensor of more than {self.limits.max_elements} elements", limit=True)
        elif isinstance(value, (tuple, list, range)) and len(value) > self.limits.max_sequence:
            raise self.p._refuse(node, f"a sequence longer than {self.limits.max_sequence}", limit=True)
        return value

    def e_Constant(self, node: ast.Constant) -> object:
        value = node.value
        if value is None or value is Ellipsis or type(value) in _SCALARS:
            return value
        raise self.p._refuse(node, f"a {type(value).__name__} constant")

    def e_Name(self, node: ast.Name) -> object:
        return self.name(node)

    def name(self, node: ast.Name) -> object:
        name = node.id
        if name.startswith("_"):
            raise self.p._refuse(node, f"the name {name!r}")
        if name in self.locals:
            return self.locals[name]
        if name in _NAMES:
            return _NAMES[name]
        if name in _BUILTINS:
            return _Builtin(name)
        raise self.p._refuse(node, f"the name {name!r} (not defined before use, or not in the interface)")

    def e_Attribute(self, node: ast.Attribute) -> object:
        attr = node.attr
        if attr.startswith("_"):
            raise self.p._refuse(node, f"the attribute {attr!r}")
        if isinstance(node.value, ast.Name) and node.value.id == "torch" and "torch" not in self.locals:
            raise self.p._refuse(node, f"torch.{attr} other than called")
        target = self.expr(node.value)
        if isinstance(target, _Features):
            if attr not in target.values:
                raise self.p._refuse(node, f"{self.p._param}.{attr} (not a field of the features)")
            return target.values[attr]
        if isinstance(target, torch.Tensor):
            if attr == "shape":
                return tuple(target.shape)
            if attr in _TENSOR_METHODS:
                return _Method(target, attr)
        if attr in ("values", "indices") and type(target).__module__ == "torch.return_types":
            return getattr(target, attr)
        raise self.p._refuse(node, f"the attribute .{attr} of {_kind(target)}")

    def e_Subscript(self, node: ast.Subscript) -> object:
        target = self.expr(node.value)
        index = self.index(node.slice)
        if isinstance(target, torch.Tensor):
            parts = index if isinstance(index, tuple) else (index,)
            for part in parts:
                if isinstance(part, torch.Tensor):
                    if part.dtype == torch.bool:
                        continue
                    if part.is_floating_point():
                        raise self.p._refuse(node, "indexing with a float tensor")
                    self.spend(node, target.numel() * max(part.numel(), 1))
                elif not (part is None or part is Ellipsis or isinstance(part, (int, slice))):
                    raise self.p._refuse(node, f"indexing a tensor with {_kind(part)}")
            return target[index]
        if isinstance(target, (tuple, list)) and isinstance(index, (int, slice)):
            return target[index]
        raise self.p._refuse(node, f"indexing {_kind(target)} with {_kind(index)}")

    def index(self, node: ast.expr) -> object:
        if isinstance(node, ast.Slice):
            parts = [None if p is None else self.expr(p) for p in (node.lower, node.upper, node.step)]
            if not all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts):
                raise self.p._refuse(node, "slice bounds other than ints")
            return slice(*parts)
        if isinstance(node, ast.Tuple):
            return tuple(self.index(elt) for elt in node.elts)
        return self.expr(node)

    def e_Tuple(self, node: ast.Tuple) -> tuple:
        return tuple(self.expr(elt) for elt in node.elts)

    def e_List(self, node: ast.List) -> list:
        return [self.expr(elt) for elt in node.elts]

    def e_IfExp(self, node: ast.IfExp) -> object:
        return self.expr(node.body if self.truth(node.test) else node.orelse)

    def e_BoolOp(self, node: ast.BoolOp) -> object:
        want = isinstance(node.op, ast.Or)
        value = None
        for child in node.values:
            value = self.expr(child)
            if bool(self.checked_truth(child, value)) == want:
                return value
        return value

    def checked_truth(self, node: ast.AST, value: object) -> bool:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise self.p._refuse(node, f"the truth value of a tensor of {value.numel()} elements")
        return bool(value)

    def e_UnaryOp(self, node: ast.UnaryOp) -> object:
        op = _UNARY.get(type(node.op))
        operand = self.expr(node.operand)
        if op is None or not isinstance(operand, (*_SCALARS, torch.Tensor)):
            raise self.p._refuse(node, f"{type(node.op).__name__} on {_kind(operand)}")
        if isinstance(node.op, ast.Not):
            return not self.checked_truth(node, operand)
        if isinstance(operand, torch.Tensor):
            self.spend(node, operand.numel())
        return op(operand)

    def e_BinOp(self, node: ast.BinOp) -> object:
        return self.binary(node, node.op, self.expr(node.left), self.expr(node.right), node.right)

    def binary(self, node: ast.AST, op_node: ast.operator, left: object, right: object, right_node: ast.expr):
        op = _BINARY.get(type(op_node))
        if op is None:
            raise self.p._refuse(node, f"the operator {type(op_node).__name__}")
        if isinstance(op_node, (ast.Pow, ast.LShift, ast.RShift)) and not _literal_number(right_node):
            raise self.p._refuse(node, f"{type(op_node).__name__} with a computed right-hand side (use a literal)")
        sequences = (tuple, list)
        if isinstance(left, sequences) or isinstance(right, sequences):
            if isinstance(op_node, ast.Add) and type(left) is type(right):
                self.room(node, len(left) + len(right))
                return op(left, right)
            raise self.p._refuse(node, f"{type(op_node).__name__} on {_kind(left)} and {_kind(right)}")
        for side in (left, right):
            if not isinstance(side, (*_SCALARS, torch.Tensor)):
                raise self.p._refuse(node, f"{type(op_node).__name__} on {_kind(side)}")
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            self.spend(node, self.bound(node, [left, right]))
            return op(left, right)
        if isinstance(left, int) and isinstance(right, int):
            self.int_room(node, op_node, left, right)
        try:
            return op(left, right)
        except (OverflowError, ZeroDivisionError, ValueError) as err:
            raise self.p._refuse(node, f"{type(op_node).__name__}: {type(err).__name__}") from None

    def int_room(self, node: ast.AST, op_node: ast.operator, left: int, right: int) -> None:
        """The bits an integer operation would produce, before it runs (a power tower never starts)."""
        bits, cap = 0, self.limits.max_int_bits
        a, b = abs(left).bit_length(), abs(right).bit_length()
        if isinstance(op_node, ast.Mult):
            bits = a + b
        elif isinstance(op_node, ast.Pow):
            bits = 0 if right < 0 or abs(left) <= 1 else math.ceil(right * math.log2(abs(left)))
        elif isinstance(op_node, ast.LShift):
            bits = a + right if right >= 0 else 0
        if bits > cap:
            raise self.p._refuse(node, f"an integer of about {bits} bits (limit {cap})", limit=True)

    def e_Compare(self, node: ast.Compare) -> object:
        left = self.expr(node.left)
        result: object = True
        for op_node, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.expr(right_node)
            op = _COMPARE.get(type(op_node))
            if op is None:
                raise self.p._refuse(node, f"the comparison {type(op_node).__name__}")
            for side in (left, right):
                if not isinstance(side, (*_SCALARS, torch.Tensor, type(None))):
                    raise self.p._refuse(node, f"comparing {_kind(side)}")
            if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
                self.spend(node, self.bound(node, [left, right]))
            value = op(left, right)
            if len(node.ops) > 1 and not self.checked_truth(node, value):
                return value
            result, left = value, right
        return result

    def e_Call(self, node: ast.Call) -> object:
        for kw in node.keywords:
            if kw.arg is None or kw.arg.startswith("_") or kw.arg in REFUSED_KEYWORDS:
                raise self.p._refuse(kw, f"the keyword argument {kw.arg or '**'}=")
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise self.p._refuse(node, "*args")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch" \
                and "torch" not in self.locals:
            fn = _TORCH.get(func.attr)
            if fn is None:
                raise self.p._refuse(node, f"torch.{func.attr}")
            label = f"torch.{func.attr}"
        else:
            fn = self.expr(func)
            label = getattr(func, "attr", getattr(func, "id", "call"))
        args = [self.expr(a) for a in node.args]
        kwargs = {kw.arg: self.expr(kw.value) for kw in node.keywords}
        for value in (*args, *kwargs.values()):
            if not _plain(value):
                raise self.p._refuse(node, f"passing {_kind(value)} to {label}")
        if isinstance(fn, _Builtin):
            return self.builtin(node, fn.name, args, kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        listed = [t for v in args if isinstance(v, (tuple, list)) for t in v if isinstance(t, torch.Tensor)]
        if isinstance(fn, _Method):
            tensors.insert(0, fn.target)
            call = getattr(fn.target, fn.name)  # fn.name is from the fixed table, never the candidate's string
        elif callable(fn) and (fn in _TORCH.values() or fn in _NAMES.values()):
            call = fn
        else:
            raise self.p._refuse(node, f"calling {_kind(fn)}")
        size = self.bound(node, tensors) if tensors else 0
        size = max(size, sum(t.numel() for t in listed))
        self.spend(node, size)
        try:
            return call(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            raise self.p._refuse(node, f"{label}(...) failed: {type(err).__name__}: {_first_line(err)}",
                                 failed=True) from None

    def builtin(self, node: ast.Call, name: str, args: list, kwargs: dict) -> object:
        if kwargs and not (name == "round" and set(kwargs) <= {"ndigits"}):
            raise self.p._refuse(node, f"keyword arguments to {name}()")
        if name == "range":
            if not 1 <= len(args) <= 3 or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
                raise self.p._refuse(node, "range() of anything but 1 to 3 ints")
            return self.range_of(node, args)
        if name in ("min", "max"):
            items = args[0] if len(args) == 1 else args
            if not isinstance(items, (tuple, list, range)) or not items:
                raise self.p._refuse(node, f"{name}() of {_kind(items)} (give two or more values, or a tuple)")
            if any(isinstance(v, torch.Tensor) and v.numel() != 1 for v in items):
                raise self.p._refuse(node, f"{name}() of tensors (use torch.{name}imum or .amax/.amin)")
            self.ops += len(items)
            return (min if name == "min" else max)(items)
        if len(args) != (1 if name != "round" else len(args)) or not args:
            raise self.p._refuse(node, f"{name}() with {len(args)} arguments")
        value = args[0]
        try:
            if name == "len":
                if not isinstance(value, (tuple, list, range, torch.Tensor)):
                    raise self.p._refuse(node, f"len() of {_kind(value)}")
                return len(value)
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise self.p._refuse(node, f"{name}() of a tensor of {value.numel()} elements")
            if not isinstance(value, (*_SCALARS, torch.Tensor)):
                raise self.p._refuse(node, f"{name}() of {_kind(value)}")
            if name == "abs":
                return abs(value)
            if name == "float":
                return float(value)
            if name == "int":
                return int(value)
            if len(args) > 2 or not all(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]):
                raise self.p._refuse(node, "round() with a non-int ndigits")
            return round(value, *args[1:], **kwargs)
        except (OverflowError, ValueError, TypeError, RuntimeError) as err:
            raise self.p._refuse(node, f"{name}() failed: {type(err).__name__}") from None

    def range_of(self, node: ast.AST, bounds: list) -> range:
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise self.p._refuse(node, "range() of anything but ints")
        if len(bounds) == 3 and bounds[2] == 0:
            raise self.p._refuse(node, "range() with step 0")
        trips = range(*bounds)
        self.room(node, len(trips))
        return trips

    # --- limits -------------------------------------------------------------------------------------

    def bound(self, node: ast.AST, values: list) -> int:
        """Elements of the broadcast result of ``values`` (an upper bound for every allowed operation)."""
        shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
        return _broadcast_numel(shapes) if shapes else 0

    def spend(self, node: ast.AST, elements: int) -> None:
        if elements > self.limits.max_elements:
            raise self.p._refuse(node, f"a tensor of {elements} elements (limit {self.limits.max_elements})",
                                 limit=True)
        self.work += elements
        if self.work > self.limits.max_work:
            raise self.p._refuse(node, f"more than {self.limits.max_work} elements of tensor work", limit=True)

    def room(self, node: ast.AST, length: int) -> None:
        if length > self.limits.max_sequence:
            raise self.p._refuse(node, f"a sequence or range of {length} items (limit {self.limits.max_sequence})",
                                 limit=True)


_EXPRESSIONS = {getattr(ast, name[2:]): fn for name, fn in vars(_Run).items() if name.startswith("e_")}


class _Builtin:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _broadcast_numel(shapes: list[tuple[int, ...]]) -> int:
    """Elements of the broadcast of ``shapes`` (NumPy rules); the largest operand when they do not broadcast
    (the operation itself will then refuse them)."""
    out: list[int] = []
    for shape in shapes:
        for i, size in enumerate(reversed(shape)):
            if i == len(out):
                out.append(size)
            elif out[i] == 1:
                out[i] = size
            elif size not in (1, out[i]):
                return max(math.prod(s) for s in shapes)
    return math.prod(out)


def _plain(value: object) -> bool:
    """A value an allowed function may receive: numbers, tensors, slices and flat sequences of them."""
    if value is None or value is Ellipsis or isinstance(value, (*_SCALARS, torch.Tensor, range, slice)):
        return True
    if isinstance(value, (tuple, list)):
        return all(v is None or isinstance(v, (*_SCALARS, torch.Tensor)) for v in value)
    return False


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, _Features):
        return "the features object"
    if isinstance(value, (_Method, _Builtin)):
        return f"the function {value.name}"
    return f"a {type(value).__name__}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _describe(node: ast.AST) -> str:
    names = {ast.ListComp: "a list comprehension", ast.GeneratorExp: "a generator expression",
             ast.Lambda: "a lambda", ast.JoinedStr: "an f-string", ast.NamedExpr: "an assignment expression (:=)",
             ast.Starred: "a starred expression", ast.Dict: "a dict display", ast.Set: "a set display",
             ast.SetComp: "a set comprehension", ast.DictComp: "a dict comprehension", ast.Await: "await",
             ast.Yield: "yield"}
    return names.get(type(node), f"the expression {type(node).__name__}")
