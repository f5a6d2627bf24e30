"""A program's memory and time at given dims, from its typed graph alone, before anything runs.

Every node's output has the elements of its shape at the call's (b, h, g, n). The interpreter evaluates the
nodes in the graph's order and drops each value after its last use, so the bytes live at once are known
exactly; an operation's scratch (torch's temporaries inside it) is added while it runs. Time is the sum of
each node's ``overhead_ns + ns_per_element x elements touched`` (x ``log2 n`` for ``rank``'s sorts; the pools
add ``ns_per_kernel`` per element and kernel entry). The constants are measured: ``CALIBRATION`` records the
run of ``benchmarks/language_cost.py`` that produced them, and that benchmark prints predicted against
measured time per operation at 1k, 4k and 32k entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsieve.language import operations as ops
from kvsieve.language.typed_graph import TypedGraph

__all__ = ["Calibration", "CALIBRATION", "Prediction", "predict", "dims_of", "REFERENCE_DIMS", "BYTES_PER_ELEMENT",
           "CALL_OVERHEAD_NS"]

BYTES_PER_ELEMENT = 4  # every tensor a program makes is float32
# the shape stage 0 prices every program at: 32k entries x 8 KV heads x 4 query heads each (a Llama-3-8B layer)
REFERENCE_DIMS = {"b": 1, "h": 8, "g": 4, "n": 32768}


@dataclass(frozen=True)
class Calibration:
    overhead_ns: float
    ns_per_element: float
    ns_per_kernel: float = 0.0  # pools: per element and kernel entry


# Read off `python benchmarks/language_cost.py` (one torch thread, float32, b 1 h 8 g 4, n 1k / 4k / 32k) on a 2-core
# AMD EPYC, torch 2.13.0 CPU, the other core busy (load ~7): each entry errs long where the table's times
# disagree between lengths (cache effects in rank and the pools), so every prediction is within 3x of a measure.
# "exp" (exp, log, log1p, sqrt) and "trig" (sin, cos) include their guard's two passes (operations.GUARDED_RANGES)
# and room for the 2-3x their remaining value classes cost (`--values`: exp and log1p of subnormals); "pow_general"
# is torch's pow of an exponent outside operations.FAST_POWERS (issue 72: x ** 4 ran 16x its old price).
CALIBRATION: dict[str, Calibration] = {
    "feature": Calibration(0.0, 0.0),
    "literal": Calibration(0.0, 0.0),
    "binary": Calibration(10_000.0, 0.2),
    "neg": Calibration(10_000.0, 0.2),
    "pow": Calibration(10_000.0, 0.3),
    "pow_general": Calibration(10_000.0, 9.0),
    "cheap": Calibration(10_000.0, 0.2),
    "exp": Calibration(10_000.0, 1.5),
    "sigmoid": Calibration(10_000.0, 0.6),
    "trig": Calibration(10_000.0, 1.8),
    "tanh": Calibration(10_000.0, 2.2),
    "group": Calibration(10_000.0, 0.15),
    "pool": Calibration(10_000.0, 1.0, 0.7),
    "max_pool": Calibration(10_000.0, 0.5, 0.1),
    "normalize": Calibration(12_000.0, 0.4),
    "unit_mean": Calibration(12_000.0, 0.4),
    "rank": Calibration(20_000.0, 18.0),
}


# one call's own work whatever the program: pricing the graph, checking the features, the wall-clock guard
CALL_OVERHEAD_NS = 10_000.0


def dims_of(batch: int, kv_heads: int, group: int, n: int) -> dict[str, int]:
    return {"b": int(batch), "h": int(kv_heads), "g": int(group), "n": int(n)}


def _elements(shape: ops.Dims, dims: dict[str, int]) -> int:
    return math.prod(dims[d] for d in shape)


def cost_key(kind: str, name: str, literals: tuple = ()) -> str:
    """The calibration entry of a node (``x ** k`` by its exponent: ``operations.pow_cost``)."""
    if kind == "call":
        return ops.FUNCTIONS[name].cost
    if kind == "pow":
        return ops.pow_cost(literals[0])
    return kind


@dataclass(frozen=True)
class Prediction:
    """What one call will spend: ``elements`` per node (0 for numbers), ``time_ns`` per node, the bytes live at
    once at their ``peak`` and the node where it is reached, and the totals."""

    elements: tuple[int, ...]
    time_ns: tuple[float, ...]
    peak_bytes: int
    peak_node: int
    largest_tensor: int
    largest_node: int

    @property
    def total_ns(self) -> float:
        return CALL_OVERHEAD_NS + float(sum(self.time_ns))


def node_time_ns(graph: TypedGraph, index: int, dims: dict[str, int]) -> float:
    """The predicted time of node ``index`` at ``dims``."""
    node = graph.nodes[index]
    if not node.computes:
        return 0.0
    cal = CALIBRATION[cost_key(node.kind, node.name, node.literals)]
    out = _elements(node.shape, dims) if node.is_tensor else 1
    touched = out
    if node.kind == "call" and ops.FUNCTIONS[node.name].touches == "input":
        touched = max(_elements(graph.nodes[i].shape, dims) for i in node.inputs)
    per_element = cal.ns_per_element
    if node.kind == "call" and node.name == "rank":
        per_element *= max(math.log2(max(dims["n"], 2)), 1.0)
    if cal.ns_per_kernel and node.literals:
        per_element += cal.ns_per_kernel * node.literals[0]
    return cal.overhead_ns + per_element * touched


def predict(graph: TypedGraph, dims: dict[str, int]) -> Prediction:
    """Simulate the interpreter's evaluation of ``graph`` at ``dims`` (features are the caller's: not counted)."""
    order = graph.live_nodes()
    uses: dict[int, int] = {}
    for index in order:
        for i in graph.nodes[index].inputs:
            uses[i] = uses.get(i, 0) + 1
    elements = [0] * len(graph.nodes)
    times = [0.0] * len(graph.nodes)
    live = peak = largest = 0
    peak_node = largest_node = graph.output
    for index in order:
        node = graph.nodes[index]
        if node.computes and node.is_tensor:
            elements[index] = _elements(node.shape, dims)
        times[index] = node_time_ns(graph, index, dims)
        if not node.computes:
            continue
        made = elements[index] * BYTES_PER_ELEMENT
        scratch = 0
        if node.kind == "call":
            scratch = int(ops.FUNCTIONS[node.name].scratch * made)
        if live + made + scratch > peak:
            peak, peak_node = live + made + scratch, index
        if made > largest:
            largest, largest_node = made, index
        live += made
        for i in node.inputs:
            uses[i] -= 1
            if uses[i] == 0 and graph.nodes[i].computes:
                live -= elements[i] * BYTES_PER_ELEMENT
    return Prediction(tuple(elements), tuple(times), peak, peak_node, largest, largest_node)
