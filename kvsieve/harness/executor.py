"""Where a grid's samples are evaluated: in this process (the default) or on Ray actors.

:func:`kvsieve.harness.runner.run_grid` decides what is missing, writes the store and shows the progress
bar; an executor only computes. The unit of work is one sample with all its missing cells
(:func:`~kvsieve.harness.runner.evaluate_sample`), so the sample's shared prefill stays shared.

- :class:`LocalGridExecutor` loads the model in this process and evaluates the samples one after the
  other: what ``run_grid`` always did.
- :class:`RayGridExecutor` runs long-lived actors that each load the model once and evaluate one
  sample at a time; the driver hands samples out as actors free up and passes each finished sample's
  rows on at once (only the driver writes the store). A worker process that dies costs only its
  sample, which is retried once on another worker (``distributed/pool.py``). Rows equal the local
  executor's: the same function runs on the same inputs (at the same number of threads per worker).

A model is given by a *factory*: a picklable callable returning ``(model, tokenizer)`` (Ray sends it to
the actors; a model itself is not sent). The default is ``kvsieve.models.load(config.model,
dtype=config.dtype)``; for Ray, ``dtype="auto"`` is resolved in the driver first, so every worker uses
the same dtype.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Protocol

from kvsieve.distributed.actors import RayActors
from kvsieve.harness.runner import Cell, GridConfig, evaluate_sample
from kvsieve.harness.store import CellResult
from kvsieve.harness.validate import load_samples
from kvsieve.models import load, resolve_dtype
from kvsieve.tasks.sample import Sample

__all__ = ["GridExecutor", "LocalGridExecutor", "RayGridExecutor", "GridWorker", "make_grid_executor",
           "EXECUTORS"]

EXECUTORS = ("local", "ray")
Work = list[tuple[Sample, list[Cell]]]


class GridExecutor(Protocol):
    def samples(self, config: GridConfig) -> list[Sample]:
        """The grid's samples, in ``load_samples`` order (generating them needs the model's tokenizer)."""
        ...

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_sample: Callable[[list[CellResult]], None]) -> None:
        """Evaluate each ``(sample, cells)``; ``on_sample(rows)`` in this process as each sample finishes."""
        ...

    def close(self) -> None: ...


def _factory(config: GridConfig, factory: Callable | None, resolve: bool = False) -> Callable:
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
            self.model, self.tokenizer = _factory(config, self.factory)()
            self._key = key

    def samples(self, config: GridConfig) -> list[Sample]:
        self._ensure(config)
        return list(load_samples(config, self.tokenizer))

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_sample: Callable[[list[CellResult]], None]) -> None:
        self._ensure(config)
        for sample, cells in work:
            on_sample(evaluate_sample(self.model, self.tokenizer, sample, cells, config.model, config.shared,
                                      run_config))

    def close(self) -> None:
        self.model = self.tokenizer = None


class GridWorker:
    """The body of one Ray actor: builds the model once, then evaluates samples."""

    def __init__(self, factory: Callable, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, int(threads)))
        self.model, self.tokenizer = factory()

    def pid(self) -> int:
        return os.getpid()

    def samples(self, config: GridConfig) -> list[Sample]:
        return list(load_samples(config, self.tokenizer))

    def evaluate(self, sample: Sample, cells: list[Cell], model_name: str, shared: bool,
                 run_config: dict) -> list[CellResult]:
        return evaluate_sample(self.model, self.tokenizer, sample, cells, model_name, shared, run_config)


class RayGridExecutor(RayActors):
    """Samples on Ray actors (see the module docstring).

    ``address``: ``None`` starts a local Ray instance with this machine's CPUs (shut down on
    :meth:`close`); ``"auto"`` or ``"HOST:PORT"`` joins a running cluster. ``workers``: actors, each
    holding one copy of the model (default: the cluster's CPUs divided by ``cpus_per_worker``; never
    more than the samples to do). ``cpus_per_worker`` is both Ray's reservation and the torch threads of
    each worker. ``on_dispatch(pid, sample)`` runs in the driver when a sample is sent to the worker
    with that process id (tests kill workers with it). ``retried`` lists ``(sample id, dead pid)`` per
    retry after a worker died.
    """

    def __init__(self, address: str | None = None, workers: int | None = None, cpus_per_worker: int = 1,
                 factory: Callable | None = None,
                 on_dispatch: Callable[[int, Sample], None] | None = None) -> None:
        super().__init__(address, workers, cpus_per_worker, on_dispatch)
        self.factory = factory
        self._key = None

    def _ensure(self, config: GridConfig):
        from kvsieve.distributed import WorkerPool

        self._connect()
        key = (config.model, config.dtype)
        if self._pool is not None and self.factory is None and key != self._key:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = WorkerPool(GridWorker, (_factory(config, self.factory, resolve=True), self.cpus_per_worker),
                                    cpus_per_worker=self.cpus_per_worker)
            self._key = key
        return self._pool

    def start(self, config: GridConfig) -> list[int]:
        """Start all the workers now and wait until each has built its model (``run`` otherwise starts them
        as it goes and hands samples only to built ones); returns their process ids."""
        pool = self._ensure(config)
        pool.grow(self.size())
        return pool.pids()

    def samples(self, config: GridConfig) -> list[Sample]:
        if config.data:  # read here: the file need not exist on the workers' machines
            return list(load_samples(config, None))
        from kvsieve.distributed.cluster import import_ray

        return import_ray().get(self._ensure(config).first().samples.remote(config))

    def pids(self) -> list[int]:
        """The workers' process ids (waits until they are built)."""
        return self._pool.pids() if self._pool is not None else []

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_sample: Callable[[list[CellResult]], None]) -> None:
        if not work:
            return
        pool = self._ensure(config)
        pool.grow(min(self.size(), len(work)))
        items = [(sample, cells, config.model, config.shared, run_config) for sample, cells in work]
        self._run(pool, items, lambda i, rows: on_sample(rows), [sample for sample, _ in work],
                  describe=lambda sample: f"sample {sample.task}/{sample.length}/{sample.id}",
                  ident=lambda sample: sample.id)


def make_grid_executor(kind: str = "local", address: str | None = None,
                       workers: int | None = None) -> LocalGridExecutor | RayGridExecutor:
    """The executor ``--executor`` names; ``--ray-address`` and ``--workers`` only apply to Ray."""
    if kind == "local":
        if address is not None or workers is not None:
            raise ValueError("--ray-address and --workers need --executor ray")
        return LocalGridExecutor()
    if kind == "ray":
        return RayGridExecutor(address=address, workers=workers)
    raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")
