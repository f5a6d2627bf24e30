"""Candidate evaluation on Ray: the evolve ``Executor`` interface (``executor.py``) over long-lived actors.

Each actor builds the model and its own :class:`~kvsieve.evolve.cascade.DevSet` once (the dev samples
prefilled on the full cache, read from the run's dev cache folder where the driver saved them, else prefilled
there and saved), then runs
:func:`~kvsieve.evolve.cascade.evaluate_program` for one candidate at a time. So a candidate's code
still runs only inside the sandbox subprocess, started by the actor on the worker's machine: a candidate
that crashes or hangs its sandbox costs that sandbox, not the actor. The loop, the mutator and the
program database stay with the driver; results reach it through ``on_result(i, evaluation)`` as they
finish (the loop stores them by slot, so finishing order does not change the database). A worker process
that dies costs only its candidate, which is retried once on another worker (``distributed/pool.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

from kvsieve.distributed import WorkerPool
from kvsieve.distributed.actors import RayActors
from kvsieve.evolve.cascade import DevSet, Evaluation, KnownKept, evaluate_program
from kvsieve.evolve.evolve_config import EvolveConfig, dev_samples
from kvsieve.evolve.sandbox import SandboxLimits
from kvsieve.language.program_source import Program
from kvsieve.models import load, resolve_dtype

__all__ = ["RayExecutor", "EvolveWorker"]


class EvolveWorker:
    """The body of one Ray actor: the model and the dev set, built once; one candidate per call."""

    def __init__(self, factory: Callable, config: EvolveConfig, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, int(threads)))
        model, tokenizer = factory()
        samples = dev_samples(config, tokenizer, config.dev_seed, config.dev_samples)
        # the driver's saved prefills where this machine sees them (else computed here and saved for the next actor)
        self.dev = DevSet(model, tokenizer, samples, config.ratios, config.window, config.dev_cache_folder,
                          surrogate=config.surrogate)
        self.fitness, self.alternate = config.fitness, config.dev_cells == "alternate"

    def pid(self) -> int:
        return os.getpid()

    def evaluate(self, source: str, max_gap: float | None, limits: SandboxLimits,
                 known: Mapping[str, KnownKept] | None = None) -> Evaluation:
        return evaluate_program(Program(source), self.dev, limits, max_gap, known, self.fitness,
                               self.alternate)


class RayExecutor(RayActors):
    """Evaluates candidates on Ray actors; the same interface and results as ``LocalExecutor``.

    ``address``: ``None`` starts a local Ray instance with this machine's CPUs (shut down on
    :meth:`close`); ``"auto"`` or ``"HOST:PORT"`` joins a running cluster. ``workers``: actors (default:
    the cluster's CPUs divided by ``cpus_per_worker``, at most one generation's candidates).
    ``factory``: a picklable callable returning ``(model, tokenizer)`` (default
    ``load(config.model, dtype=config.dtype)``, with ``"auto"`` resolved in the driver). ``limits`` may be
    changed between calls.
    ``on_dispatch(pid, program)`` runs in the driver when a candidate is sent to the worker with that
    process id. ``retried`` lists ``(code hash, dead pid)`` per retry after a worker died.
    """

    def __init__(self, config: EvolveConfig, limits: SandboxLimits | None = None, address: str | None = None,
                 workers: int | None = None, cpus_per_worker: int = 1, factory: Callable | None = None,
                 on_dispatch: Callable[[int, Program], None] | None = None) -> None:
        super().__init__(address, workers, cpus_per_worker, on_dispatch)
        self.config = config
        self.limits = limits or SandboxLimits()
        if factory is None:  # "auto" decided here, so every worker computes in the driver's dtype
            factory = functools.partial(load, config.model, dtype=resolve_dtype(config.dtype))
        self.factory = factory

    def _ensure(self):
        self._connect()
        if self._pool is None:
            self._pool = WorkerPool(EvolveWorker, (self.factory, self.config, self.cpus_per_worker),
                                    cpus_per_worker=self.cpus_per_worker)
            self._pool.grow(min(self.size(), self.config.islands * self.config.per_island))
        return self._pool

    def pids(self) -> list[int]:
        """The workers' process ids (starts them if needed, and waits until they are built)."""
        return self._ensure().pids()

    def evaluate(self, programs: list[Program], max_gap: float | None = None,
                 on_result: Callable[[int, Evaluation], None] | None = None,
                 known: Mapping[str, KnownKept] | None = None) -> list[Evaluation]:
        pool = self._ensure()
        out: list[Evaluation | None] = [None] * len(programs)

        def done(i: int, evaluation: Evaluation) -> None:
            out[i] = evaluation
            if on_result is not None:
                on_result(i, evaluation)

        self._run(pool, [(p.source, max_gap, self.limits, known) for p in programs], done, programs,
                  describe=lambda p: f"candidate {p.code_hash}", ident=lambda p: p.code_hash)
        return out
