"""Check a grid before any work starts: nothing is loaded or computed."""

from __future__ import annotations

from pathlib import Path

from kvsieve.models import check_length
from kvsieve.policies.label import DECODE, MODES, Point
from kvsieve.selection import Budget
from kvsieve.tasks.load import ALL_TASKS, read_samples

__all__ = ["validate"]


def validate(config) -> None:
    """Raise ValueError naming the bad value. The specs were parsed (names and parameters checked) when
    the :class:`~kvsieve.harness.grid.GridConfig` was made; no policy is built here."""
    specs = [*config.policies, *config.qa_policies]
    if not specs:
        raise ValueError("the grid is empty: give at least one policy")
    for spec in specs:
        if spec.needs_spans and config.data and Path(config.data).is_file():
            no_spans = [s.id for s in read_samples(config.data)[: config.samples] if not s.spans]
            if no_spans:
                raise ValueError(f"{spec.text} keeps the answer's spans, and {len(no_spans)} sample(s) of "
                                 f"{config.data} carry none (e.g. {no_spans[0]!r}); give a file whose samples have "
                                 "'spans' (kvsieve generate writes them) or drop it")
    if any(Point(spec).compresses for spec in specs) and not config.ratios:
        raise ValueError("the grid is empty: give at least one compression ratio")
    for ratio in config.ratios:
        Budget(ratio=ratio)
    if config.mode not in MODES:
        raise ValueError(f"mode {config.mode!r} is not one of {', '.join(map(repr, MODES))}")
    if config.mode == DECODE:
        if not config.point_mode.is_decode:  # Mode refuses what is not an int in range
            raise ValueError(f"chunk_size must be a positive int, got {config.chunk_size!r}")
        if config.question_aware or config.qa_policies:
            raise ValueError("question-aware cells read the question with the context, which decode-time eviction "
                             "has already evicted from: use mode 'prefill' for them")
        for spec in config.policies:
            if spec.needs_spans or spec.needs_whole_context:
                raise ValueError(f"policy {spec.text!r} cannot evict in decode mode (it needs "
                                 f"{'the answer spans' if spec.needs_spans else 'the whole context after the prefill'}"
                                 "); use mode 'prefill' for it")
    if config.samples is not None and (isinstance(config.samples, bool) or not isinstance(config.samples, int)
                                       or config.samples < 1):
        raise ValueError(f"samples must be an int >= 1 (or unset), got {config.samples!r}")
    if config.data:
        if not Path(config.data).is_file():
            raise ValueError(f"data file {config.data} does not exist")
        return
    if not config.tasks:
        raise ValueError("the grid is empty: give at least one task")
    unknown = [t for t in config.tasks if t not in ALL_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown))}; available: {', '.join(ALL_TASKS)}")
    if not config.lengths:
        raise ValueError("the grid is empty: give at least one length")
    for length in config.lengths:
        check_length(config.model, length)
