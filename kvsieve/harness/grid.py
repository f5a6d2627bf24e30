"""One evaluation grid: its configuration (:class:`GridConfig`) and the cells it expands to.

The grid's policy specs are parsed once, here, into :class:`~kvsieve.policies.registry.PolicySpec`s; a cell is a
:class:`~kvsieve.policies.label.Point` holding its spec, and validation, the runner and the store read those.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvsieve.bundled import canonical_name
from kvsieve.policies.label import DECODE, FULL_CACHE, Mode, Point
from kvsieve.policies.registry import PolicySpec, parse
from kvsieve.recall import Recall
from kvsieve.tasks.load import SampleSpec

__all__ = ["GridConfig", "cells_for"]


@dataclass
class GridConfig:
    """One evaluation grid. ``policies`` are specs; ``full`` runs once per sample at ratio 0."""

    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    policies: list[str] = field(default_factory=lambda: [FULL_CACHE, "snapkv"])
    ratios: list[float] = field(default_factory=lambda: [0.5])
    samples: int | None = None  # per task and length; None: 5 generated, or every sample of ``data``
    seed: int = 0
    store: str = "results/results.sqlite"
    question_aware: bool = False  # run every compressing policy question-aware as well
    qa_policies: list[str] = field(default_factory=list)  # policies also run question-aware (reference lines)
    data: str | None = None  # JSONL of samples (kvsieve generate format or LongBench) instead of generating
    dtype: str = "auto"  # bf16 where the CPU computes it natively, else float32 (kvsieve.models.auto_dtype)
    shared: bool = True  # one prefill per sample and batched decoding; False: the naive per-cell loop
    # "decode": decode-time eviction (kvsieve.attach(mode="decode")): the context is read in chunks of
    # ``chunk_size`` tokens and the cache held under the budget after each, then the question and the
    # answer; stored as policy "SPEC@decodeN". Each cell then reads the whole sample itself.
    mode: str = "prefill"
    chunk_size: int = 128
    evict_every: int = 1  # decode mode: generated tokens between evictions (the engine's default is 32)
    # prefill mode: each compressing policy at each ratio also runs with each of these recalls (kvsieve/recall.py,
    # "recall(fraction=0.025, chunk=16)"), stored as "SPEC@recall(...)"; a recall not below a ratio's kept share
    # is skipped at that ratio
    recalls: list[str] = field(default_factory=list)
    # seconds that program: policies interpreted in this process may spend in all, over the whole run (each call
    # has its own cost budgets and deadline besides); once spent, further program cells fail. None: unbounded
    program_budget_s: float | None = 3600.0

    def __post_init__(self) -> None:
        budget = self.program_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget > 0):
            raise ValueError(f"program_budget_s must be a number of seconds > 0 (or None), got {budget!r}")
        # one name per bundled model in the store, whichever alias the user typed
        self.model = canonical_name(self.model)
        # a single value where a list belongs (``tasks = "vt"`` in a TOML file, ``ratios = 0.5``) means a
        # list of one; anything else that is not a list is named with the field it was given for
        for name in ("tasks", "lengths", "policies", "ratios", "qa_policies", "recalls"):
            value = getattr(self, name)
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
            elif not isinstance(value, list):
                raise ValueError(f"{name} must be a list (or a single value), got {type(value).__name__} {value!r}")
        # the specs are parsed once, here: unknown names and parameters fail before any work
        self.policies = [spec if isinstance(spec, PolicySpec) else parse(spec) for spec in self.policies]
        self.qa_policies = [spec if isinstance(spec, PolicySpec) else parse(spec) for spec in self.qa_policies]
        self.recalls = [r if isinstance(r, Recall) else Recall.parse(r) for r in self.recalls]
        if self.recalls and self.mode == DECODE:
            raise ValueError("recalls are a prefill setting: a decode-mode grid evicts while it reads the question")

    def as_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON-ready values (specs as their text)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["policies"] = [spec.text for spec in self.policies]
        out["qa_policies"] = [spec.text for spec in self.qa_policies]
        out["recalls"] = [recall.text for recall in self.recalls]
        return out

    @property
    def point_mode(self) -> Mode:
        """The cells' :class:`~kvsieve.policies.label.Mode`: decode-time eviction with this grid's chunk and eviction
        interval, or prefill compression (``Mode`` checks both numbers)."""
        return Mode(self.chunk_size, self.evict_every) if self.mode == DECODE else Mode()

    def sample_spec(self) -> SampleSpec:
        """Which samples this grid reads (generated or from ``data``)."""
        return SampleSpec(model=self.model, tasks=list(self.tasks), lengths=list(self.lengths), samples=self.samples,
                          seed=self.seed, data=self.data)


def cells_for(config: GridConfig) -> list[Point]:
    """Every point of the grid: each compressing policy at each ratio (and question-aware where asked), the full
    cache once at ratio 0, in the grid's mode; question-aware reference policies in prefill mode."""
    mode = config.point_mode
    cells: list[Point] = []
    for spec in config.policies:
        point = Point(spec, 0.0, False, mode)
        if not point.compresses:  # the full cache: once per sample
            cells.append(point)
            continue
        for ratio in config.ratios:
            cells.append(point.at(float(ratio)))
            cells.extend(Point(spec, float(ratio), False, Mode(recall=recall)) for recall in config.recalls
                         if recall.fraction < 1 - float(ratio))
            if config.question_aware:
                cells.append(Point(spec, float(ratio), True))
    for spec in config.qa_policies:
        for ratio in config.ratios:
            cell = Point(spec, float(ratio), True)
            if cell not in cells:
                cells.append(cell)
    return cells
