"""Candidates are data: an interpreter over a program's syntax tree, so no candidate code ever runs as Python.

A program (``program.py`` format) is parsed, never compiled. :class:`ScoreProgram` walks the body of
``def score(f)`` node by node; each node maps to one allowed operation from a fixed table (the
helpers, builtins, ``torch`` functions and tensor methods of ``features.py``).

The cost model: before an operation runs, the interpreter predicts from its inputs' shapes the
elements it will create (the broadcast of its operands; indexing by index tensors: the broadcast of
the index shapes times the dims left; boolean masks, reductions and ``roll`` at their upper bound)
and the work it will do (elements touched, times the window of ``pool`` / ``max_pool``, the dims of
``roll``, the sort passes of ``rank``), and charges them against budgets that scale with the call's
problem (:class:`Limits`, :func:`budgets`): any one tensor, the elements live at once (every tensor a
name, a tuple, a list or a pending operand still holds) and the total work of the call, each a small
multiple of the elements the call receives. A program linear in the context so runs at any length,
and one that builds an n x n intermediate is refused at every length, before it pays for it.
:func:`work_growth` measures a program's work at n and 2n (stage 1 refuses superlinear growth).
Bits of an integer, length of a sequence, operations and a wall-clock deadline are bounded too.
Python's ``getattr``, ``exec`` and ``compile`` are never called on anything from the candidate: a
name or attribute that is not in the tables does not exist for it. Every error a program can cause is
an :class:`InterpreterError` naming its line.

The interpreter is an allowlist on its own (``static_check=False`` shows that in the tests): any
node it has no rule for is refused with the line it is on. By default the source first passes the
stage-0 check (``static.check_source``), so the two agree on what a program is.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvsieve.language import program_features as feats
from kvsieve.language.program_source import fields_read
from kvsieve.language.static_check import REFUSED_KEYWORDS, StaticCheckError, check_source

__all__ = ["Limits", "ScoreProgram", "InterpreterError", "LimitExceeded", "ProgramFailed", "REFUSED_KEYWORDS",
           "Budgets", "Cost", "Growth", "budgets", "work_growth", "run_budget", "MAX_WORK_EXPONENT"]

# Stage 1 refuses a program whose work grows faster than n^1.3 between n and 2n: linear programs grow as 1.0,
# rank's sort as ~1.15 (n log n); an n x n intermediate as 2, a pool kernel that grows with n as up to 2.
MAX_WORK_EXPONENT = 1.3

class InterpreterError(ValueError):
    """The program asked for something the interpreter has no rule for (the message names it and its line)."""


class LimitExceeded(InterpreterError):
    """An operation would exceed one of the :class:`Limits` (checked before it runs)."""


class ProgramFailed(InterpreterError):
    """An allowed operation raised (wrong shapes, an index out of range): the program's own error."""


@dataclass(frozen=True)
class Limits:
    """What one call of ``score`` may create or spend.

    The cost model's budgets are multiples of the elements the call receives (``inputs``: the features'
    tensors, (2g + 3) b h n + n for b h n entries scored and g query heads per KV head), with a floor of
    ``min_budget`` elements for tiny problems: ``tensor_per_input`` for any one tensor, ``memory_per_input``
    for the elements live at once, ``work_per_input`` for the element work of the call. Absolute backstops:
    ``max_elements`` (any one tensor, 16 M float32 = 64 MiB), ``max_work`` (element work of one call),
    ``max_ops`` (syntax nodes evaluated), ``max_int_bits`` (bits of any Python integer), ``max_sequence``
    (length of a tuple, list or range), ``deadline_s`` (wall clock of one call).
    """

    max_elements: int = 1 << 24
    max_work: int = 1 << 32
    max_ops: int = 1_000_000
    max_int_bits: int = 64
    max_sequence: int = 4096
    deadline_s: float | None = 60.0
    tensor_per_input: int = 4
    memory_per_input: int = 16
    work_per_input: int = 256
    min_budget: int = 1 << 12

    def __post_init__(self) -> None:
        for name in ("max_elements", "max_work", "max_ops", "max_int_bits", "max_sequence", "tensor_per_input",
                     "memory_per_input", "work_per_input", "min_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"Limits.deadline_s must be > 0 or None, got {self.deadline_s!r}")


@dataclass(frozen=True)
class Budgets:
    """One call's budgets in elements, from :func:`budgets`: ``inputs`` (elements received), ``tensor`` (any one
    tensor), ``memory`` (live at once, inputs not counted) and ``work`` (element work of the call)."""

    inputs: int
    tensor: int
    memory: int
    work: int


def budgets(limits: Limits, inputs: int) -> Budgets:
    """The budgets of a call that receives ``inputs`` elements: multiples of them, floored at ``min_budget`` and
    capped by the absolute backstops."""
    def scaled(factor: int, cap: int) -> int:
        return min(max(factor * inputs, limits.min_budget), cap)

    return Budgets(inputs, scaled(limits.tensor_per_input, limits.max_elements),
                   scaled(limits.memory_per_input, limits.max_elements * limits.memory_per_input),
                   scaled(limits.work_per_input, limits.max_work))


@dataclass(frozen=True)
class Cost:
    """What one call spent: element ``work``, the most elements ``peak`` live at once, ``ops`` evaluated."""

    work: int
    peak: int
    ops: int


class _RunBudget:
    """Seconds of interpretation left to a whole run (:func:`run_budget`), shared by every call in it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.spent = float(seconds), 0.0


_RUN_BUDGETS: list[_RunBudget] = []


@contextlib.contextmanager
def run_budget(seconds: float | None) -> Iterator[None]:
    """Bound the seconds every program interpreted in this process spends, in total, inside the block (a whole
    ``kvsieve eval`` run): once they are spent, each further call stops at once with :class:`LimitExceeded`.
    ``None``: no bound beyond each call's own."""
    if seconds is None:
        yield
        return
    if not seconds > 0:
        raise ValueError(f"a run's program budget must be > 0 seconds or None, got {seconds!r}")
    _RUN_BUDGETS.append(_RunBudget(seconds))
    try:
        yield
    finally:
        _RUN_BUDGETS.pop()


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
    """A program's ``score(f)`` as data; calling it on :class:`~kvsieve.language.program_features.Features`
    interprets it.

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
        except MemoryError:
            raise self._refuse(self._fn, "out of memory", limit=True) from None
        finally:
            self.last_cost = run.finish()
        raise self._refuse(self._fn, "score(f) returned nothing: a score function without return")


class _Run:
    """The state of one call: local names, what has been spent, and what is live."""

    def __init__(self, program: ScoreProgram, features: feats.Features) -> None:
        self.p, self.limits = program, program.limits
        values = {name: getattr(features, name) for name in (*feats.TENSOR_FIELDS, *feats.SCALAR_FIELDS)}
        self.locals: dict[str, object] = {program._param: _Features(values)}
        self.ops = self.work = 0
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        self.budgets = budgets(self.limits, sum(t.numel() for t in tensors))
        # live memory: every storage a tensor the program made still holds, counted once however many views
        # share it; the inputs are not the program's. A weak reference per tensor object releases its share.
        self.inputs = {_storage(t)[0] for t in tensors}
        self.storages: dict[int, list[int]] = {}  # storage address -> [elements, tensor objects holding it]
        self.held: dict[int, weakref.ref] = {}
        self.live = self.peak = 0
        self.started = time.monotonic()
        deadline = self.limits.deadline_s
        self.deadline = None if deadline is None else self.started + deadline
        self.deadline_why = f"running longer than {deadline:g} s" if deadline is not None else ""
        self.shared = _RUN_BUDGETS[-1] if _RUN_BUDGETS else None
        if self.shared is not None:
            left = self.shared.seconds - self.shared.spent
            if left <= 0:
                raise program._refuse(program._fn, f"the run's budget of {self.shared.seconds:g} s for programs "
                                      "is spent", limit=True)
            if self.deadline is None or self.started + left < self.deadline:
                self.deadline = self.started + left
                self.deadline_why = f"the run's budget of {self.shared.seconds:g} s for programs spent"

    def finish(self) -> Cost:
        if self.shared is not None:
            self.shared.spent += time.monotonic() - self.started
        self.held.clear()  # the weak references die with it: nothing is charged to a finished call
        return Cost(self.work, self.peak, self.ops)

    def tick(self, node: ast.AST) -> None:
        self.ops += 1
        if self.ops > self.limits.max_ops:
            raise self.p._refuse(node, f"more than {self.limits.max_ops} operations", limit=True)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise self.p._refuse(node, self.deadline_why, limit=True)

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
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError, KeyError, ArithmeticError) as err:
            raise self.p._refuse(node, f"{type(err).__name__}: {_first_line(err)}", failed=True) from None
        except MemoryError:
            raise self.p._refuse(node, "out of memory", limit=True) from None
        return self.checked(node, value)

    def checked(self, node: ast.AST, value: object) -> object:
        """Every value an operation made, checked once more after the fact (the prediction is the guard)."""
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            if value.bit_length() > self.limits.max_int_bits:
                raise self.p._refuse(node, f"an integer above {self.limits.max_int_bits} bits", limit=True)
        elif isinstance(value, torch.Tensor):
            if value.numel() > self.budgets.tensor:
                raise self.p._refuse(node, f"a tensor of more than {self.budgets.tensor} elements", limit=True)
            self.hold(node, value)
        elif isinstance(value, (tuple, list, range)) and len(value) > self.limits.max_sequence:
            raise self.p._refuse(node, f"a sequence longer than {self.limits.max_sequence}", limit=True)
        elif isinstance(value, (tuple, list)) or type(value).__module__ == "torch.return_types":
            for item in value:
                if isinstance(item, torch.Tensor):
                    self.hold(node, item)
        return value

    def hold(self, node: ast.AST, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as live until the last tensor object of the program holding it is gone."""
        key = id(tensor)
        if key in self.held:
            return
        address, size = _storage(tensor)
        if address in self.inputs or size == 0:
            return
        entry = self.storages.get(address)
        if entry is None:
            entry = self.storages[address] = [size, 0]
            self.live += size
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        self.held[key] = weakref.ref(tensor, lambda _, key=key, address=address: self.release(key, address))
        if self.live > self.budgets.memory:  # the prediction is the guard; this is the check after the fact
            raise self.p._refuse(node, self.memory_text(self.live), limit=True)

    def release(self, key: int, address: int) -> None:
        self.held.pop(key, None)
        entry = self.storages.get(address)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.live -= entry[0]
                del self.storages[address]

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
                    if part.is_floating_point():
                        raise self.p._refuse(node, "indexing with a float tensor")
                elif not (part is None or part is Ellipsis or isinstance(part, (int, slice))):
                    raise self.p._refuse(node, f"indexing a tensor with {_kind(part)}")
            if any(isinstance(part, torch.Tensor) for part in parts):  # a copy; basic indexing is a view
                elements = _index_numel(tuple(target.shape), parts)
                self.charge(node, elements, elements + sum(p.numel() for p in parts if isinstance(p, torch.Tensor)))
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
            self.charge(node, operand.numel())
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
            self.charge(node, self.bound(node, [left, right]))
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
                self.charge(node, self.bound(node, [left, right]))
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
            name, operands = fn.name, [fn.target, *args]
        elif callable(fn) and (fn in _TORCH.values() or fn in _NAMES.values()):
            call = fn
            name, operands = _FUNCTION_NAMES.get(fn, str(label)), args
        else:
            raise self.p._refuse(node, f"calling {_kind(fn)}")
        if name in feats.HELPERS:
            self.helper_arguments(node, name, args, kwargs)
        size = self.bound(node, tensors) if tensors else 0
        size = max(size, sum(t.numel() for t in listed))
        work, peak = self.call_cost(node, name, operands, kwargs, size)
        self.charge(node, size, work, peak)
        try:
            return call(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError, KeyError, ArithmeticError) as err:
            raise self.p._refuse(node, f"{label}(...) failed: {type(err).__name__}: {_first_line(err)}",
                                 failed=True) from None
        except MemoryError:
            raise self.p._refuse(node, f"{label}(...) ran out of memory", limit=True) from None

    def helper_arguments(self, node: ast.AST, name: str, args: list, kwargs: dict) -> None:
        """A helper's arguments, checked before it runs: a tensor first (never an int: the helpers would fail
        inside with an error that is not the program's line), the right rank, a kernel in range."""
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor):
            raise self.p._refuse(node, f"{name}() of {_kind(x)}: its first argument must be a tensor")
        if name in ("group_max", "group_mean") and x.dim() < 3:
            raise self.p._refuse(node, f"{name}() of {_kind(x)}: it needs (b, h, g, n) with dim 2 the query heads")
        if name in ("pool", "max_pool"):
            k = args[1] if len(args) > 1 else kwargs.get("k")
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= _MAX_KERNEL:
                raise self.p._refuse(node, f"{name}() with kernel {k!r}: give an int in [1, {_MAX_KERNEL}]")

    def call_cost(self, node: ast.AST, name: str, operands: list, kwargs: dict, size: int) -> tuple[int, int]:
        """``(work, peak)`` of one call whose result has at most ``size`` elements: the elements it touches times
        its passes over them, and what it holds at once (``roll`` over several dims keeps a copy per dim)."""
        if name in ("pool", "max_pool"):
            k = operands[1] if len(operands) > 1 else kwargs.get("k", 1)
            return size * (k | 1), 2 * size
        if name == "rank":
            n = operands[0].shape[-1] if operands[0].dim() else 1
            passes = 2 * max(1, math.ceil(math.log2(max(n, 2)))) + 2  # two stable sorts and the scaling
            return size * passes, 5 * size  # two int64 orders live beside the result
        if name == "roll":
            dims = operands[2] if len(operands) > 2 else kwargs.get("dims")
            shifts = operands[1] if len(operands) > 1 else kwargs.get("shifts")
            spec = dims if dims is not None else shifts
            count = len(spec) if isinstance(spec, (tuple, list)) else 1
            return size * max(count, 1), size * (max(count, 1) + 1)
        factor = _PASSES.get(name, 1)
        return size * factor, size * _HELD.get(name, 1)

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

    def charge(self, node: ast.AST, elements: int, work: int | None = None, peak: int | None = None) -> None:
        """Refuse an operation before it runs if its result (``elements``), what it holds at once (``peak``,
        default its result) on top of what is live, or the call's total ``work`` would exceed the budgets."""
        b = self.budgets
        if elements > b.tensor:
            raise self.p._refuse(node, f"a tensor of {elements} elements ({self.limit_text(b.tensor, 'tensor')})",
                                 limit=True)
        need = self.live + (elements if peak is None else peak)
        if need > b.memory:
            raise self.p._refuse(node, self.memory_text(need), limit=True)
        self.work += elements if work is None else work
        if self.work > b.work:
            raise self.p._refuse(node, f"more than {b.work} elements of tensor work in one call "
                                 f"({self.limit_text(b.work, 'work')})", limit=True)

    def memory_text(self, elements: int) -> str:
        return (f"{elements} elements live at once ({self.limit_text(self.budgets.memory, 'memory')}; "
                f"{self.live} held now)")

    def limit_text(self, cap: int, kind: str) -> str:
        factor = {"tensor": self.limits.tensor_per_input, "memory": self.limits.memory_per_input,
                  "work": self.limits.work_per_input}[kind]
        return f"limit {cap}: {factor} x the {self.budgets.inputs} elements the call receives"

    def room(self, node: ast.AST, length: int) -> None:
        if length > self.limits.max_sequence:
            raise self.p._refuse(node, f"a sequence or range of {length} items (limit {self.limits.max_sequence})",
                                 limit=True)


_EXPRESSIONS = {getattr(ast, name[2:]): fn for name, fn in vars(_Run).items() if name.startswith("e_")}
_FUNCTION_NAMES = {fn: name for name, fn in (*_TORCH.items(), *feats.HELPERS.items())}
_MAX_KERNEL = 257  # features.pool / max_pool's own bound
# passes over the elements (work) and results held at once (peak) per call, beyond one of each
_PASSES = {"softmax": 3, "logsumexp": 3, "std": 2, "var": 2, "normalize": 3, "unit_mean": 3}
_HELD = {"softmax": 2, "logsumexp": 2, "std": 2, "var": 2, "normalize": 2, "unit_mean": 2}


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """The address of ``tensor``'s storage and its size in 4-byte elements (views share both)."""
    storage = tensor.untyped_storage()
    size = storage.nbytes()
    return storage.data_ptr(), (size + 3) // 4


def _index_numel(shape: tuple[int, ...], parts: tuple) -> int:
    """Elements of ``tensor[parts]`` when some parts are index tensors (an upper bound, before it runs): the
    broadcast of the index tensors' shapes (a boolean mask as if every element were true) times the sizes of
    the dims no int or index tensor consumes."""
    consumed = sum(p.dim() if isinstance(p, torch.Tensor) and p.dtype == torch.bool else 1
                   for p in parts if isinstance(p, (int, torch.Tensor)) and not isinstance(p, bool))
    expanded: list = []
    for part in parts:
        if part is Ellipsis:
            expanded.extend([slice(None)] * max(0, len(shape) - consumed - sum(
                isinstance(p, slice) for p in parts)))
        else:
            expanded.append(part)
    index_shapes, keep, dim = [], 1, 0
    for part in expanded:
        if part is None or isinstance(part, bool):
            continue
        if isinstance(part, torch.Tensor):
            if part.dtype == torch.bool:
                index_shapes.append((part.numel(),))
                dim += part.dim()
            else:
                index_shapes.append(tuple(part.shape))
                dim += 1
        elif isinstance(part, slice):
            keep *= shape[dim] if dim < len(shape) else 1
            dim += 1
        else:
            dim += 1
    keep *= math.prod(shape[dim:])
    return _broadcast_numel(index_shapes) * keep


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


@dataclass(frozen=True)
class Growth:
    """A program's element work at two context lengths, and the exponent of its growth between them."""

    n: tuple[int, int]
    work: tuple[int, int]

    @property
    def exponent(self) -> float:
        (n1, n2), (w1, w2) = self.n, self.work
        return math.log(max(w2, 1) / max(w1, 1)) / math.log(n2 / n1)

    def __str__(self) -> str:
        (n1, n2), (w1, w2) = self.n, self.work
        return f"work {w1} at n {n1}, {w2} at n {n2} (grows as n^{self.exponent:.2f})"


def work_growth(program: ScoreProgram, window: int, n: int | None = None) -> Growth:
    """The work of ``program`` on synthetic features (b 1, h 2, g 3) at ``n`` and ``2 n`` entries (default
    ``n``: stage 1's long case, 4 window + 37). A program linear in the context grows as n^1; stage 1 refuses
    one above :data:`MAX_WORK_EXPONENT`. Its limits and errors propagate (:class:`InterpreterError`)."""
    n = 4 * window + 37 if n is None else int(n)
    work = []
    for size in (n, 2 * n):
        program(feats.synthetic_features(0, batch=1, kv_heads=2, group=3, n=size, window=window))
        work.append(program.last_cost.work)
    return Growth((n, 2 * n), (work[0], work[1]))
