"""Samples on Ray actors: long-lived workers that each load the model once (see ``executor.py``'s docstring).

A worker process that dies costs only its sample, which is retried once on another worker
(``distributed/pool.py``). Only the driver writes the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kvsieve.distributed import WorkerPool
from kvsieve.distributed.actors import RayActors
from kvsieve.distributed.cluster import import_ray
from kvsieve.harness.evaluate import evaluate_sample
from kvsieve.harness.executor import Work, model_factory
from kvsieve.harness.grid import GridConfig
from kvsieve.harness.store import CellResult
from kvsieve.models import dtype_name
from kvsieve.policies.label import Point
from kvsieve.tasks.load import load_samples
from kvsieve.tasks.sample import Sample

__all__ = ["GridWorker", "RayGridExecutor"]


class GridWorker:
    """The body of one Ray actor: builds the model once, then evaluates samples."""

    def __init__(self, factory: Callable, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, int(threads)))
        self.model, self.tokenizer = factory()

    def pid(self) -> int:
        return os.getpid()

    def samples(self, config: GridConfig) -> list[Sample]:
        return list(load_samples(config.sample_spec(), self.tokenizer))

    def dtype(self) -> str:
        return dtype_name(self.model)

    def evaluate(self, sample: Sample, cells: list[Point], model_name: str, shared: bool,
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
        self._connect()
        key = (config.model, config.dtype)
        if self._pool is not None and self.factory is None and key != self._key:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            factory = model_factory(config, self.factory, resolve=True)
            self._pool = WorkerPool(GridWorker, (factory, self.cpus_per_worker), cpus_per_worker=self.cpus_per_worker)
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
            return list(load_samples(config.sample_spec(), None))
        return import_ray().get(self._ensure(config).first().samples.remote(config))

    def dtype(self, config: GridConfig) -> str:
        return import_ray().get(self._ensure(config).first().dtype.remote())

    def pids(self) -> list[int]:
        """The workers' process ids (waits until they are built)."""
        return self._pool.pids() if self._pool is not None else []

    def run(self, config: GridConfig, work: Work, run_config: dict,
            on_rows: Callable[[list[CellResult]], None]) -> None:
        if not work:
            return
        pool = self._ensure(config)
        pool.grow(min(self.size(), len(work)))
        items = [(sample, cells, config.model, config.shared, run_config) for sample, cells in work]
        self._run(pool, items, lambda i, rows: on_rows(rows), [sample for sample, _ in work],
                  describe=lambda sample: f"sample {sample.task}/{sample.length}/{sample.id}",
                  ident=lambda sample: sample.id)
