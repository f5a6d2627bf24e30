"""A pool of long-lived Ray actors that each run one task at a time, with a retry when a worker dies.

Every actor is built once (it loads the model, prefills what it caches) and then serves many tasks, so
that cost is paid once per worker process, not once per task. :meth:`WorkerPool.run` hands items out as
actors free up (the slow ones get fewer) and calls ``on_done(i, result)`` in the driver as each task
finishes, in finishing order.

Faults: when an actor's process dies (killed, out of memory, a crash in native code), Ray fails its
task with ``RayActorError``; the pool replaces that actor with a fresh one and puts the item back at the
front of the queue, so the next free worker (another actor, or the replacement) runs it. An item whose
worker dies more than ``max_retries`` times ends the run with :class:`WorkerLost`. An exception raised by
the task's own code is not a worker fault: it is not retried and reaches the caller as Ray raises it (an
instance of the original exception type as well). If ``run`` ends early (that exception, Ctrl-C), the
actors still busy are killed, so a later ``run`` starts from idle workers.

An actor class used here must have a ``pid()`` method (its process id): the pool asks it first, so it is
known once the actor is built, and tests use it to kill a worker.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from kvsieve.distributed.cluster import import_ray

__all__ = ["WorkerPool", "WorkerLost"]


class WorkerLost(RuntimeError):
    """A task's worker died more often than the pool retries."""


class _Worker:
    def __init__(self, handle, pid_ref) -> None:
        self.handle, self.pid_ref, self._pid = handle, pid_ref, None
        self.built = False  # answered pid(): construction is over (it may still have failed)

    def pid(self) -> int:
        """The actor's process id (waits until the actor is built); -1 if it died before answering."""
        if self._pid is None:
            from ray.exceptions import RayActorError

            try:
                self._pid = int(import_ray().get(self.pid_ref))
            except RayActorError:
                return -1
            finally:
                self.built = True
        return self._pid


class WorkerPool:
    """Up to ``size`` actors of ``actor_class(*args)`` with ``cpus_per_worker`` CPUs each (Ray's resource
    accounting: a node with 16 CPUs runs 16 one-CPU workers). Actors start lazily (:meth:`grow`)."""

    def __init__(self, actor_class: type, args: Sequence[Any] = (), cpus_per_worker: float = 1.0,
                 max_retries: int = 1) -> None:
        ray = import_ray()
        self._remote = ray.remote(num_cpus=cpus_per_worker, max_restarts=0, max_task_retries=0)(actor_class)
        self.args = tuple(args)
        self.max_retries = max_retries
        self.workers: list[_Worker] = []
        self.retried: list[tuple[int, int]] = []  # (item index, pid of the worker that died), per retry
        self.replaced = 0

    def grow(self, size: int) -> None:
        """Start actors until ``size`` are alive (their construction runs in parallel, in the background)."""
        while len(self.workers) < size:
            handle = self._remote.remote(*self.args)
            self.workers.append(_Worker(handle, handle.pid.remote()))  # the first call: answered once built

    def first(self):
        """An actor handle to call directly (e.g. to ask something of the model); starts one if none."""
        self.grow(1)
        return self.workers[0].handle

    def pids(self) -> list[int]:
        return [w.pid() for w in self.workers]

    def _retire(self, worker: _Worker) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
        try:
            import_ray().kill(worker.handle, no_restart=True)
        except Exception:  # already gone
            pass

    def run(self, method: str, items: Sequence[tuple], on_done: Callable[[int, Any], None],
            on_dispatch: Callable[[int, int], None] | None = None, describe: Callable[[int], str] = str) -> None:
        """Call ``actor.method(*items[i])`` for every ``i`` on the pool's actors; ``on_done(i, result)`` as each
        finishes. Items go only to built actors (one still waiting for CPUs or loading gets none yet).
        ``on_dispatch(pid, i)``, if given, runs in the driver after item ``i`` is sent to the worker with
        process id ``pid``. ``describe(i)`` names an item in messages. Needs at least one actor (:meth:`grow`)."""
        ray = import_ray()
        from ray.exceptions import RayActorError

        if not self.workers:
            raise ValueError("the pool has no workers: call grow() first")
        queue = deque(range(len(items)))
        deaths: Counter[int] = Counter()
        failed_builds = 0
        idle = list(self.workers)
        running: dict = {}  # ObjectRef -> (item index, worker)

        def replace(worker: _Worker) -> None:
            self._retire(worker)
            self.replaced += 1
            self.grow(len(self.workers) + 1)
            idle.append(self.workers[-1])

        try:
            while queue or running:
                for worker in [w for w in idle if w.built]:
                    if not queue:
                        break
                    i = queue.popleft()
                    idle.remove(worker)
                    running[getattr(worker.handle, method).remote(*items[i])] = (i, worker)
                    if on_dispatch is not None:
                        on_dispatch(worker.pid(), i)
                building = {w.pid_ref: w for w in idle if not w.built} if queue else {}
                [ref], _ = ray.wait(list(running) + list(building), num_returns=1)
                if ref in building:  # a worker finished building (or died doing it)
                    worker = building[ref]
                    if worker.pid() < 0:
                        failed_builds += 1
                        err = _error_of(ref)
                        replace_it = failed_builds <= max(3, 2 * len(self.workers))
                        idle.remove(worker)
                        if not replace_it:
                            raise WorkerLost(f"workers keep dying while they are built ({err})")
                        print(f"kvsieve: a worker died while it was built ({err}); starting another", file=sys.stderr)
                        replace(worker)
                    continue
                i, worker = running.pop(ref)
                try:
                    result = ray.get(ref)
                except RayActorError as err:
                    deaths[i] += 1
                    dead_pid = worker.pid()
                    replace(worker)
                    if deaths[i] > self.max_retries:
                        raise WorkerLost(f"{describe(i)}: its worker died {deaths[i]} times "
                                         f"({type(err).__name__}: {_first_line(err)})") from err
                    self.retried.append((i, dead_pid))
                    print(f"kvsieve: a worker process (pid {dead_pid}) died ({type(err).__name__}); "
                          f"retrying {describe(i)} on another worker", file=sys.stderr)
                    queue.appendleft(i)
                    continue
                idle.append(worker)
                on_done(i, result)
        finally:
            for _, worker in running.values():  # abandoned work (an error, Ctrl-C): free those actors
                self._retire(worker)

    def close(self) -> None:
        for worker in list(self.workers):
            self._retire(worker)


def _error_of(ref) -> str:
    try:
        import_ray().get(ref)
    except Exception as err:  # the reason the actor died
        return f"{type(err).__name__}: {_first_line(err)}"
    return "no error"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""
