"""Candidates are data: a program's typed graph evaluated node by node, never run as Python.

:class:`ScoreProgram` builds the graph once (``typed_graph``: parse, types, shapes). Each call first prices the
whole graph at the call's dims (``cost.predict``): the bytes live at once, the largest tensor and the time, each
against a budget that scales with the elements the call receives (:class:`Limits`); a program over any budget
is refused with the line of the node that crosses it, before the first operation runs. Because every operation
of the language is one bounded torch kernel on tensors whose sizes the graph fixes, nothing can run longer or
hold more than it was priced at, whatever the inputs' values.

A second layer checks as it runs: every node's result has the shape the graph predicted, an operation's own
error is a :class:`ProgramFailed` naming its line (never a torch exception), and a wall-clock guard and a run's
shared budget (:func:`run_budget`) are checked between operations. Their hits are :class:`WallClockExceeded`:
the machine was slow, which says nothing of the program.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvsieve.language import operations as ops
from kvsieve.language import program_features as feats
from kvsieve.language.cost import BYTES_PER_ELEMENT, Prediction, dims_of, predict
from kvsieve.language.typed_graph import ProgramRefused, TypedGraph, build_graph

__all__ = ["Limits", "ScoreProgram", "InterpreterError", "LimitExceeded", "ProgramFailed", "WallClockExceeded",
           "Budgets", "Cost", "Growth", "budgets", "work_growth", "run_budget", "MAX_WORK_EXPONENT"]

# Every operation is linear in the context but rank (n log n): a program's predicted time grows between n and 2n as
# at most n^1.15 or so. Stage 1 reports the exponent; 1.3 leaves room for the log factor at small n.
MAX_WORK_EXPONENT = 1.3


class InterpreterError(ValueError):
    """A program that cannot run (the message names the file and line): refused, over a limit, or failed."""


class LimitExceeded(InterpreterError):
    """The program's predicted memory or time at this call's dims exceeds a budget (decided before it runs)."""


class WallClockExceeded(LimitExceeded):
    """An infrastructure guard: the wall clock or the run's shared budget ran out between two operations. It
    depends on the machine's load, so evolution retries it instead of recording it as the candidate's result."""


class ProgramFailed(InterpreterError):
    """An operation raised or returned a shape other than the predicted one: the program's own error."""


@dataclass(frozen=True)
class Limits:
    """What one call of ``score`` may hold and spend, as multiples of the elements it receives (``inputs``:
    (2g + 3) b h n + n): ``memory_per_input`` float32 elements live at once, ``tensor_per_input`` elements in
    any one tensor, ``time_per_input_ns`` predicted nanoseconds, each floored at ``min_budget`` elements (or
    ``min_time_ns``) for tiny problems. ``max_elements`` caps any one tensor outright (64 MiB of float32).
    ``deadline_s`` is the wall-clock guard of one call (None: none)."""

    memory_per_input: int = 16
    tensor_per_input: int = 4
    time_per_input_ns: float = 400.0
    min_budget: int = 1 << 12
    min_time_ns: float = 50e6
    max_elements: int = 1 << 24
    deadline_s: float | None = 60.0

    def __post_init__(self) -> None:
        for name in ("memory_per_input", "tensor_per_input", "min_budget", "max_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        for name in ("time_per_input_ns", "min_time_ns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"Limits.{name} must be a finite number > 0, got {value!r}")
        if self.deadline_s is not None and not (isinstance(self.deadline_s, (int, float)) and self.deadline_s > 0):
            raise ValueError(f"Limits.deadline_s must be > 0 or None, got {self.deadline_s!r}")


@dataclass(frozen=True)
class Budgets:
    """One call's budgets: ``inputs`` (elements received), ``memory_bytes`` live at once, ``tensor_bytes`` in any
    one tensor, ``time_ns`` predicted."""

    inputs: int
    memory_bytes: int
    tensor_bytes: int
    time_ns: float


def budgets(limits: Limits, inputs: int) -> Budgets:
    floor = max(inputs, limits.min_budget)
    tensor = min(limits.tensor_per_input * floor, limits.max_elements)
    return Budgets(inputs, limits.memory_per_input * floor * BYTES_PER_ELEMENT, tensor * BYTES_PER_ELEMENT,
                   max(limits.time_per_input_ns * inputs, limits.min_time_ns))


def input_elements(dims: dict[str, int]) -> int:
    b, h, g, n = dims["b"], dims["h"], dims["g"], dims["n"]
    return (2 * g + 3) * b * h * n + n


@dataclass(frozen=True)
class Cost:
    """One call: the predicted ``time_ns`` and ``peak_bytes``, the ``ops`` evaluated and the measured ``seconds``."""

    time_ns: float
    peak_bytes: int
    ops: int
    seconds: float


class _RunBudget:
    """Seconds of interpretation left to a whole run (:func:`run_budget`), shared by every call in it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.spent = float(seconds), 0.0


_RUN_BUDGETS: list[_RunBudget] = []


@contextlib.contextmanager
def run_budget(seconds: float | None) -> Iterator[None]:
    """Bound the seconds every program interpreted in this process spends, in total, inside the block (a whole
    ``kvsieve eval`` run): once they are spent, each further call stops with :class:`WallClockExceeded`.
    ``None``: no bound beyond each call's own."""
    if seconds is None:
        yield
        return
    if not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
        raise ValueError(f"a run's program budget must be a finite number of seconds > 0 or None, got {seconds!r}")
    _RUN_BUDGETS.append(_RunBudget(seconds))
    try:
        yield
    finally:
        _RUN_BUDGETS.pop()


class ScoreProgram:
    """A program's ``score(f)`` as a typed graph; calling it on
    :class:`~kvsieve.language.program_features.Features` prices it, then evaluates it."""

    def __init__(self, source: str, limits: Limits = Limits(), filename: str = "<program>") -> None:
        self.filename, self.limits = filename, limits
        try:
            self.graph: TypedGraph = build_graph(source, filename)
        except ProgramRefused as err:
            raise InterpreterError(str(err)) from None
        self.last_cost: Cost | None = None

    @property
    def fields(self) -> set[str]:
        """The feature fields ``score`` reads."""
        return self.graph.fields

    def predict(self, batch: int, kv_heads: int, group: int, n: int) -> Prediction:
        return predict(self.graph, dims_of(batch, kv_heads, group, n))

    def where(self, index: int) -> str:
        return f"{self.filename} line {self.graph.nodes[index].line}"

    def check_budgets(self, dims: dict[str, int]) -> Prediction:
        """Price the graph at ``dims``; raise :class:`LimitExceeded` naming the line that crosses a budget."""
        prediction = predict(self.graph, dims)
        limit = budgets(self.limits, input_elements(dims))
        at = "at " + ", ".join(f"{k} = {v}" for k, v in dims.items())
        if prediction.largest_tensor > limit.tensor_bytes:
            raise LimitExceeded(f"{self.where(prediction.largest_node)}: limit: a tensor of "
                                f"{prediction.largest_tensor / 2**20:.1f} MiB, over the "
                                f"{limit.tensor_bytes / 2**20:.1f} MiB any one tensor may hold {at}")
        if prediction.peak_bytes > limit.memory_bytes:
            raise LimitExceeded(f"{self.where(prediction.peak_node)}: limit: {prediction.peak_bytes / 2**20:.1f} MiB "
                                f"live at once, over the budget of {limit.memory_bytes / 2**20:.1f} MiB {at}")
        if prediction.total_ns > limit.time_ns:
            spent, crossing = 0.0, self.graph.output
            for index, ns in enumerate(prediction.time_ns):
                spent += ns
                if spent > limit.time_ns:
                    crossing = index
                    break
            raise LimitExceeded(f"{self.where(crossing)}: limit: predicted {prediction.total_ns / 1e6:.1f} ms, over "
                                f"the budget of {limit.time_ns / 1e6:.1f} ms {at}")
        return prediction

    def __call__(self, features: feats.Features) -> torch.Tensor:
        dims = _dims(features, self.filename)
        prediction = self.check_budgets(dims)
        run = _Run(self, features, dims)
        try:
            value = run.evaluate()
        finally:
            self.last_cost = Cost(prediction.total_ns, prediction.peak_bytes, run.ops, run.finish())
        return value


def _dims(features: feats.Features, filename: str) -> dict[str, int]:
    """(b, h, g, n) of ``features``, each tensor checked against its declared shape."""
    attn = features.attn
    if not isinstance(attn, torch.Tensor) or attn.dim() != 4:
        raise InterpreterError(f"{filename}: features.attn must be a (b, h, g, n) tensor")
    b, h, g, n = (int(s) for s in attn.shape)
    dims = dims_of(b, h, g, n)
    for name in feats.TENSOR_FIELDS:
        tensor = getattr(features, name)
        expected = tuple(dims[d] for d in ops.FEATURE_TYPES[name])
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
            raise InterpreterError(f"{filename}: features.{name} shaped {tuple(getattr(tensor, 'shape', ()))}, "
                                   f"expected {expected}")
    return dims


class _Run:
    """One call: the values of the live nodes, dropped after their last use."""

    def __init__(self, program: ScoreProgram, features: feats.Features, dims: dict[str, int]) -> None:
        self.p, self.features, self.dims = program, features, dims
        self.ops = 0
        self.started = time.monotonic()
        deadline = program.limits.deadline_s
        self.deadline = None if deadline is None else self.started + deadline
        self.deadline_why = f"running longer than {deadline:g} s" if deadline is not None else ""
        self.shared = _RUN_BUDGETS[-1] if _RUN_BUDGETS else None
        if self.shared is not None:
            left = self.shared.seconds - self.shared.spent
            if left <= 0:
                raise WallClockExceeded(f"{program.filename}: limit: the run's budget of {self.shared.seconds:g} s for "
                                        "programs is spent")
            if self.deadline is None or self.started + left < self.deadline:
                self.deadline = self.started + left
                self.deadline_why = f"the run's budget of {self.shared.seconds:g} s for programs spent"

    def finish(self) -> float:
        seconds = time.monotonic() - self.started
        if self.shared is not None:
            self.shared.spent += seconds
        return seconds

    def evaluate(self) -> torch.Tensor:
        graph = self.p.graph
        order = graph.live_nodes()
        uses: dict[int, int] = {}
        for index in order:
            for i in graph.nodes[index].inputs:
                uses[i] = uses.get(i, 0) + 1
        values: dict[int, object] = {}
        for index in order:
            node = graph.nodes[index]
            if self.deadline is not None and node.computes and time.monotonic() > self.deadline:
                raise WallClockExceeded(f"{self.p.where(index)}: limit: {self.deadline_why}")
            values[index] = self.node(index, [values[i] for i in node.inputs])
            for i in node.inputs:
                uses[i] -= 1
                if uses[i] == 0:
                    del values[i]
        return values[graph.output]

    def node(self, index: int, args: list) -> object:
        node = self.p.graph.nodes[index]
        if node.kind == "feature":
            value = getattr(self.features, node.name)
            return float(value) if node.shape == ops.SCALAR else value
        if node.kind == "literal":
            return node.value
        self.ops += 1
        try:
            if node.kind == "binary":
                value = ops.BINARY_OPERATORS[node.name](*args)
            elif node.kind == "neg":
                value = -args[0]
            elif node.kind == "pow":
                value = args[0] ** node.literals[0]
            else:
                value = ops.FUNCTIONS[node.name].run(*args, *node.literals)
        except (ZeroDivisionError, OverflowError, ArithmeticError) as err:  # numbers only: tensors give inf/NaN
            raise ProgramFailed(f"{self.p.where(index)}: {type(err).__name__}: {err}") from None
        except MemoryError:
            raise LimitExceeded(f"{self.p.where(index)}: limit: out of memory") from None
        except Exception as err:  # noqa: BLE001 - torch's own errors become the program's, with its line
            raise ProgramFailed(f"{self.p.where(index)}: {node.name}: {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}") from None
        expected = tuple(self.dims[d] for d in node.shape)
        if node.shape == ops.SCALAR:
            if isinstance(value, torch.Tensor) or not math.isfinite(value):
                raise ProgramFailed(f"{self.p.where(index)}: {node.name} gave {value!r}, not a finite number")
        elif not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
            raise ProgramFailed(f"{self.p.where(index)}: {node.name} gave shape "
                                f"{tuple(getattr(value, 'shape', ()))}, the graph predicted {expected}")
        return value


@dataclass(frozen=True)
class Growth:
    """A program's predicted time at two context lengths, and the exponent of its growth between them."""

    n: tuple[int, int]
    time_ns: tuple[float, float]

    @property
    def exponent(self) -> float:
        (n1, n2), (t1, t2) = self.n, self.time_ns
        return math.log(max(t2, 1.0) / max(t1, 1.0)) / math.log(n2 / n1)

    def __str__(self) -> str:
        (n1, n2), (t1, t2) = self.n, self.time_ns
        return f"{t1 / 1e3:.0f} us at n {n1}, {t2 / 1e3:.0f} us at n {n2} (grows as n^{self.exponent:.2f})"


def work_growth(program: ScoreProgram, n: int = 1 << 16, batch: int = 1, kv_heads: int = 8, group: int = 4) -> Growth:
    """The predicted time of ``program`` at ``n`` and ``2 n`` entries (no operation runs). Every operation is linear
    in n but ``rank``; per-call overheads make small n look flatter, so measure at thousands of entries."""
    times = [program.predict(batch, kv_heads, group, size).total_ns for size in (n, 2 * n)]
    return Growth((n, 2 * n), (times[0], times[1]))
