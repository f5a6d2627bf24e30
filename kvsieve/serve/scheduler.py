"""A bounded queue in front of one worker thread: one request on the model at a time.

``kvsieve.attach`` installs one policy on the model for the duration of a request, so two requests with
different operating points cannot share the model at once; on a CPU one forward at a time is also what the
cores can do. Requests wait in a queue of at most ``max_queue``; a full queue is refused at once (the app
answers 429 with ``Retry-After``) instead of growing latency without bound.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["Job", "QueueFull", "Scheduler"]


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Job:
    """One queued request: ``run(job)`` executes on the worker thread; ``cancel()`` asks it to stop."""

    def __init__(self, run: Callable[[Job], object]) -> None:
        self.run = run
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.enqueued_at = time.perf_counter()
        self.started_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()


_STOP = object()


class Scheduler:
    def __init__(self, max_queue: int = 16) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._seconds: list[float] = []  # recent service times, for Retry-After
        self._accepting = True
        self._thread = threading.Thread(target=self._work, name="kvsieve-serve-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean recent service time times the requests ahead."""
        recent = self._seconds[-20:]
        mean = sum(recent) / len(recent) if recent else 1.0
        return max(1, math.ceil(mean * (self._waiting + self.running)))

    def submit(self, run: Callable[[Job], object]) -> Job:
        with self._lock:
            if not self._accepting:
                raise QueueFull(self.retry_after())
            # the worker takes a job off the queue as soon as it is idle, so waiting counts the jobs behind it
            if self._waiting >= self.max_queue and (self._running is not None or self._waiting > 0):
                raise QueueFull(self.retry_after())
            job = Job(run)
            self._waiting += 1
            self._queue.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            with self._lock:
                self._waiting -= 1
                self._running = job
            job.started_at = time.perf_counter()
            try:
                if not job.future.set_running_or_notify_cancel():
                    continue
                if job.cancelled.is_set():
                    raise RuntimeError("cancelled while queued")
                job.future.set_result(job.run(job))
            except BaseException as err:  # the request's failure, never the worker's
                job.future.set_exception(err)
            finally:
                self._seconds.append(time.perf_counter() - job.started_at)
                del self._seconds[:-100]
                with self._lock:
                    self._running = None

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new jobs, finish the queued and running ones, stop the worker; False if it did not stop."""
        with self._lock:
            self._accepting = False
        self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()
