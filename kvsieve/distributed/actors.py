"""What the grid and evolution executors on Ray share: the connection, the worker pool's lifecycle and
one ``run`` that reports retries. Each executor adds only its actor class and its unit of work."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvsieve.distributed.cluster import connect
from kvsieve.distributed.pool import WorkerPool


class RayActors:
    """``address``: ``None`` starts a local Ray instance (shut down on :meth:`close`), ``"auto"`` or
    ``"HOST:PORT"`` joins a cluster. ``workers``: actors (default: the cluster's CPUs divided by
    ``cpus_per_worker``). ``on_dispatch(pid, payload)`` runs in the driver when a payload is sent to the
    worker with that process id. ``retried`` lists ``(id of the payload, dead pid)`` per retry."""

    def __init__(self, address: str | None, workers: int | None, cpus_per_worker: int,
                 on_dispatch: Callable[[int, Any], None] | None) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be >= 1, got {cpus_per_worker}")
        self.address, self.workers, self.cpus_per_worker = address, workers, int(cpus_per_worker)
        self.on_dispatch = on_dispatch
        self.retried: list[tuple[str, int]] = []
        self._connection = None
        self._pool: WorkerPool | None = None

    def _connect(self) -> None:
        if self._connection is None:
            self._connection = connect(self.address)

    def size(self) -> int:
        """The number of workers to run (before any cap the executor applies)."""
        if self.workers is not None:
            return self.workers
        return max(1, self._connection.cpus() // self.cpus_per_worker)

    def _run(self, pool: WorkerPool, items: Sequence[tuple], on_done: Callable[[int, Any], None],
             payloads: Sequence[Any], describe: Callable[[Any], str], ident: Callable[[Any], str]) -> None:
        """``pool.run("evaluate", ...)``; ``payloads[i]`` is what item ``i`` is about (dispatch, retries)."""
        dispatch = None
        if self.on_dispatch is not None:
            def dispatch(pid: int, i: int) -> None:
                self.on_dispatch(pid, payloads[i])
        before = len(pool.retried)
        try:
            pool.run("evaluate", items, on_done, dispatch, describe=lambda i: describe(payloads[i]))
        finally:
            self.retried += [(ident(payloads[i]), pid) for i, pid in pool.retried[before:]]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._connection is not None:
            self._connection.close()
            self._connection = None
