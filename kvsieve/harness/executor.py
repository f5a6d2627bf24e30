"""Where a grid's samples are evaluated: in this process (the default) or on Ray actors.

:func:`kvsieve.harness.run.run_grid` decides what is missing, writes the store and shows the progress
bar; an executor only computes. The unit of work is one sample with all its missing cells
(:func:`~kvsieve.harness.evaluate.evaluate_sample`), so the sample's shared prefill stays shared.

- :class:`LocalGridExecutor` loads the model in this process and evaluates the samples one after the
  other: what ``run_grid`` always did.
- :class:`~kvsieve.harness.ray_executor.RayGridExecutor` runs long-lived actors that each load the
  model once and evaluate one sample at a time; the driver hands samples out as actors free up and
  passes each finished sample's rows on at once (only the driver writes the store). A worker process
  that dies costs only its sample, which is retried once on another worker (``distributed/pool.py``).
  Rows equal the local executor's: the same function runs on the same inputs (same threads per worker).

A model is given by a *factory*: a picklable callable returning ``(model, tokenizer)`` (Ray sends it to
the actors; a model itself is not sent). The default is ``kvsieve.models.load(config.model,
dtype=config.dtype)``; for Ray, ``dtype="auto"`` is resolved in the driver first, so every worker uses
the same dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.store import CellResult
from kvsieve.models import dtype_name, load, resolve_dtype
from kvsieve.policies.label import Point
from kvsieve.tasks.load import load_samples
from kvsieve.tasks.sample import Sample

__all__ = ["GridExecutor", "LocalGridExecutor", "model_factory", "Work"]

Work = list[tuple[Sample, list[Point]]]


class GridExecutor(Protocol):
    def samples(self, config: GridConfig) -> list[Sample]:
        """The grid's samples, in ``load_samples`` order (generating them needs the model's tokenizer)."""
        ...

    def dtype(self, config: GridConfig) -> str:
        """The dtype its models compute in, named as rows record it (``"float32"``, ``"bfloat16"``)."""
        ...

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_rows: Callable[[list[CellResult]], None]) -> None:
        """Evaluate each ``(sample, cells)``; ``on_rows(rows)`` in this process as rows finish (each decoded
        batch here, each sample on Ray)."""
        ...

    def close(self) -> None: ...


def model_factory(config: GridConfig, factory: Callable | None, resolve: bool = False) -> Callable:
    """``factory``, else ``load(config.model, dtype)``; ``resolve``: ``"auto"`` is decided here, in the
    driver, so workers on machines with other CPU features still compute in the same dtype."""
    if factory is not None:
        return factory
    return functools.partial(load, config.model, dtype=resolve_dtype(config.dtype) if resolve else config.dtype)


class LocalGridExecutor:
    """Today's loop: the model in this process, one sample after the other. ``factory`` replaces
    ``load(config.model, dtype=config.dtype)`` (tests pass a tiny model)."""

    def __init__(self, factory: Callable | None = None) -> None:
        self.factory = factory
        self._key = None
        self.model = self.tokenizer = None

    def _ensure(self, config: GridConfig) -> None:
        key = (config.model, config.dtype)
        if self.model is None or (self.factory is None and key != self._key):
            self.model, self.tokenizer = model_factory(config, self.factory)()
            self._key = key

    def samples(self, config: GridConfig) -> list[Sample]:
        self._ensure(config)
        return list(load_samples(config.sample_spec(), self.tokenizer))

    def dtype(self, config: GridConfig) -> str:
        self._ensure(config)
        return dtype_name(self.model)

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_rows: Callable[[list[CellResult]], None]) -> None:
        self._ensure(config)
        for sample, cells in work:
            evaluate_sample(self.model, self.tokenizer, sample, cells, config.model, config.shared, run_config,
                            on_rows=on_rows)

    def close(self) -> None:
        self.model = self.tokenizer = None
