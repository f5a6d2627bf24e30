"""One evaluation grid: its configuration (:class:`GridConfig`) and the cells it expands to.

Light on purpose (no torch): the CLI builds and checks a grid before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsieve.bundled import canonical_name
from kvsieve.spec import parse_spec

__all__ = ["Cell", "GridConfig", "cells_for", "parse_spec"]

@dataclass(frozen=True)
class Cell:
    policy: str  # spec, e.g. "snapkv" or "snapkv(window=32)"
    ratio: float
    question_aware: bool = False
    chunk_size: int = 0  # > 0: decode-time eviction, the context read in chunks of this many tokens

    @property
    def label(self) -> str:
        """The policy as the store keys it: the spec, with ``@decodeN`` for decode-time eviction."""
        return f"{self.policy}@decode{self.chunk_size}" if self.chunk_size else self.policy


@dataclass
class GridConfig:
    """One evaluation grid. ``policies`` are specs; ``full`` runs once per sample at ratio 0."""

    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    policies: list[str] = field(default_factory=lambda: ["full", "snapkv"])
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

    def __post_init__(self) -> None:
        # one name per bundled model in the store, whichever alias the user typed
        self.model = canonical_name(self.model)
        # a single value where a list belongs (``tasks = "vt"`` in a TOML file, ``ratios = 0.5``) means a
        # list of one; anything else that is not a list is named with the field it was given for
        for name in ("tasks", "lengths", "policies", "ratios", "qa_policies"):
            value = getattr(self, name)
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
            elif not isinstance(value, list):
                raise ValueError(f"{name} must be a list (or a single value), got {type(value).__name__} {value!r}")


def cells_for(config: GridConfig) -> list[Cell]:
    cells: list[Cell] = []
    chunk = config.chunk_size if config.mode == "decode" else 0
    for spec in config.policies:
        name, _ = parse_spec(spec)
        if name == "full":
            cells.append(Cell(spec, 0.0, chunk_size=chunk))
            continue
        for ratio in config.ratios:
            cells.append(Cell(spec, float(ratio), chunk_size=chunk))
            if config.question_aware:
                cells.append(Cell(spec, float(ratio), True))
    for spec in config.qa_policies:
        for ratio in config.ratios:
            cell = Cell(spec, float(ratio), True)
            if cell not in cells:
                cells.append(cell)
    return cells


