"""Continuous batching by KV bytes: one thread owns the model; requests are admitted against a byte budget.

Each admitted request is prefilled and compressed at its own point, under its own ``kvsieve.attach``
(prefill mode); its cache then joins the running decode batch (``stack_caches``, at admission only). Every
decode step is one batched forward of all running rows under ``attach(model, FullCache())`` (nothing is
compressed then; kvsieve's attention reads the ragged rows), each row at its own position. A finished or
cancelled row leaves the batch (``batch_select_indices``) and its bytes return to the budget.

What a request is charged (exact bytes, at the model's dtype; ``b`` is one token's KV bytes in every layer):

* while it is prefilled: ``b x prompt tokens`` (twice that for a policy that rebuilds the context, KVzip)
  plus the reserve below, so both of its phases fit before it starts;
* once it decodes: the bytes its cache allocates (``cache_allocated_bytes``) after ``reserve_room`` gave every
  segment room for ``max_tokens`` more entries: its compressed entries (``usage.kv_cache.bytes_kept``), the
  question read after a query-agnostic compression, and ``b x max_tokens``. Decoding then appends in place
  and allocates nothing more; stacking keeps each request's own layout, so a batch allocates what its
  requests would alone.

A request is admitted (first come, first served) only when the charges of the running requests plus its own
fit the budget; the sum of charges never exceeds it. A request arriving when the budget (counting those
already waiting) cannot hold it waits, at most ``max_queue`` of them; beyond that it is refused at once with
a Retry-After (the app answers 429). Not charged: the brief copy ``stack_caches`` makes when a request joins.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvsieve.engine.attach import attach
from kvsieve.engine.cache import cache_allocated_bytes, reserve_room, stack_caches
from kvsieve.engine.generate import eos_ids
from kvsieve.policy import FullCache
from kvsieve.prompt import Prompt
from kvsieve.serve.generation import CacheInfo, Cancelled, Completion, bytes_per_token, prefill
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.text_stream import IncrementalText, cut_at_stop

__all__ = ["Job", "QueueFull", "TooLarge", "Scheduler"]


class QueueFull(Exception):
    def __init__(self, retry_after: int, message: str = "") -> None:
        super().__init__(message or f"the KV budget is full; retry after {retry_after} s")
        self.retry_after = retry_after


class TooLarge(Exception):
    """A request whose bytes alone exceed the whole budget: it could never be admitted."""


@dataclass(eq=False)
class Job:
    """One request: its prompt at its point, callbacks to the app, and its place in the batch."""

    prompt: Prompt
    chosen: ChosenPoint
    max_tokens: int
    stops: tuple[str, ...] = ()
    on_prefilled: Callable[[CacheInfo], None] | None = None
    on_text: Callable[[str], None] | None = None
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    need: int = 0  # bytes charged while it is prefilled (set by the scheduler)
    reserve: int = 0  # bytes its cache may grow by while decoding
    charge: int = 0  # bytes charged now
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    # decoding state
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    info: CacheInfo | None = None
    first_token_seconds: float | None = None
    decode_started: float = 0.0
    stream: IncrementalText | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """Admits jobs against ``budget`` bytes and decodes every admitted job in one batch (see the module doc)."""

    def __init__(self, model, tokenizer, budget: int, max_queue: int = 16) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"the KV budget must be a positive number of bytes, got {budget!r}")
        self.model, self.tokenizer = model, tokenizer
        self.budget, self.max_queue = budget, max_queue
        self.token_bytes = bytes_per_token(model)
        self.eos = eos_ids(model, tokenizer)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._rows: list[Job] = []  # the running batch, in cache row order
        self._prefilling: Job | None = None
        self._cache = None
        self._logits: torch.Tensor | None = None
        self.charged = 0  # bytes charged to admitted jobs now
        self.peak_charged = 0  # the most ever charged at once (never above the budget)
        self.peak_rows = 0  # the most rows one decode step ran
        self.steps = self.row_steps = 0  # decode steps, and rows summed over them (mean rows in flight)
        self._seconds: collections.deque[float] = collections.deque(maxlen=50)  # recent service times
        self._accepting = True
        self._thread = threading.Thread(target=self._work, name="kvsieve-serve-scheduler", daemon=True)
        self._thread.start()

    # -- what the app reads ---------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows) + (self._prefilling is not None)

    def retry_after(self) -> int:
        """Seconds until the budget likely has room: recent service time, shared by the running rows, times the
        requests ahead."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, math.ceil(mean * (len(self._waiting) + 1) / max(1, self.running)))

    def need_of(self, prompt: Prompt, chosen: ChosenPoint, max_tokens: int) -> tuple[int, int]:
        """(bytes charged while prefilled, decode reserve) of a request (see the module docstring)."""
        tokens = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
        prefill_bytes = self.token_bytes * tokens
        if chosen.compresses and chosen.point.policy.needs_reconstruction:
            prefill_bytes *= 2  # KVzip repeats the context over a copy of the cache
        reserve = self.token_bytes * max_tokens
        return prefill_bytes + reserve, reserve

    def submit(self, job: Job) -> Job:
        job.need, job.reserve = self.need_of(job.prompt, job.chosen, job.max_tokens)
        if job.need > self.budget:
            raise TooLarge(f"this request needs {job.need} bytes of KV cache ({job.need - job.reserve} for its "
                           f"prompt, {job.reserve} for max_tokens={job.max_tokens}); the server's --kv-budget is "
                           f"{self.budget} bytes: shorten the prompt or max_tokens")
        with self._cond:
            if not self._accepting:
                raise QueueFull(self.retry_after(), "the server is shutting down")
            ahead = self.charged + sum(j.need for j in self._waiting)
            if ahead + job.need > self.budget and len(self._waiting) >= self.max_queue:
                raise QueueFull(self.retry_after(), f"the KV budget is full ({self.charged} of {self.budget} bytes "
                                                    f"admitted, {len(self._waiting)} waiting)")
            self._waiting.append(job)
            self._cond.notify()
        return job

    # -- the model thread -------------------------------------------------------------------------------
    def _fits(self, job: Job) -> bool:
        return self.charged + job.need <= self.budget

    def _charge(self, delta: int) -> None:
        with self._cond:
            self.charged += delta
            self.peak_charged = max(self.peak_charged, self.charged)

    def _next(self) -> Job | None:
        """The next job to admit, or None; blocks while there is nothing to do. Raises StopIteration at close."""
        with self._cond:
            while True:
                for job in [j for j in self._waiting if j.cancelled.is_set()]:
                    self._waiting.remove(job)
                    job.future.set_exception(Cancelled())
                if self._waiting and self._fits(self._waiting[0]):
                    job = self._waiting.popleft()
                    self._prefilling = job
                    self.charged += job.need
                    self.peak_charged = max(self.peak_charged, self.charged)
                    return job
                if self._rows:
                    return None
                if not self._accepting and not self._waiting:
                    raise StopIteration
                self._cond.wait(0.5)

    def _work(self) -> None:
        while True:
            try:
                job = self._next()
            except StopIteration:
                return
            if job is not None:
                self._admit(job)
                continue  # admit every job that fits before the next decode step
            try:
                self._step()
            except BaseException as err:  # noqa: BLE001 - a failed batched forward fails its rows, not the server
                rows, self._rows, self._cache, self._logits = self._rows, [], None, None
                for row in rows:
                    self._release(row)
                    row.future.set_exception(err)

    def _release(self, job: Job) -> None:
        with self._cond:
            self.charged -= job.charge
            job.charge = 0
            if job.started_at is not None:
                self._seconds.append(time.perf_counter() - job.started_at)
            self._cond.notify_all()

    def _admit(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        job.charge = job.need
        try:
            if not job.future.set_running_or_notify_cancel() or job.cancelled.is_set():
                raise Cancelled()
            done = prefill(self.model, job.prompt, job.chosen)
        except BaseException as err:  # noqa: BLE001 - the request's failure, never the scheduler's
            self._prefilling = None
            self._release(job)
            if not job.future.done():
                job.future.set_exception(err)
            return
        job.info = done.info
        job.position = done.info.prompt_tokens
        job.stream = IncrementalText(self.tokenizer, job.stops)
        # from the prefill charge down to what its cache allocates once every segment has room for max_tokens
        # more (so decoding appends in place and allocates nothing): its entries, its question and that room
        charge = cache_allocated_bytes(reserve_room(done.cache, job.max_tokens))
        self._charge(charge - job.need)
        job.charge = charge
        if job.on_prefilled is not None:
            job.on_prefilled(done.info)
        job.decode_started = time.perf_counter()
        # window queries, query statistics and hidden states are dropped: decoding compresses nothing
        self._cache = stack_caches([done.cache] if self._cache is None else [self._cache, done.cache])
        logits = done.logits[None].to(torch.float32)
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._rows.append(job)
        self._prefilling = None

    def _finish(self, job: Job, stopped: bool) -> None:
        self._release(job)
        text, cut = cut_at_stop(self.tokenizer.decode(job.tokens, skip_special_tokens=True), job.stops)
        if job.on_text is not None:
            rest = job.stream.finish(text)
            if rest:
                job.on_text(rest)
        finish = "stop" if stopped or cut or len(job.tokens) < job.max_tokens else "length"
        if job.first_token_seconds is None and job.tokens:
            job.first_token_seconds = time.perf_counter() - job.started_at
        job.future.set_result(Completion(text, job.tokens, finish, job.info,
                                         time.perf_counter() - job.decode_started, job.first_token_seconds))

    @torch.no_grad()
    def _step(self) -> None:
        """Pick every row's next token; drop finished rows; one batched forward of the rest."""
        chosen = self._logits.argmax(dim=-1)
        keep: list[int] = []
        for i, job in enumerate(self._rows):
            if job.cancelled.is_set():
                self._release(job)
                job.future.set_exception(Cancelled())
                continue
            token = int(chosen[i])
            if token in self.eos:
                self._finish(job, stopped=True)
                continue
            job.tokens.append(token)
            if job.first_token_seconds is None:
                job.first_token_seconds = time.perf_counter() - job.started_at
            text = self.tokenizer.decode(job.tokens, skip_special_tokens=True) if job.stops else ""
            if job.stops and any(s in text for s in job.stops):
                self._finish(job, stopped=True)
                continue
            if len(job.tokens) >= job.max_tokens:
                self._finish(job, stopped=False)
                continue
            if job.on_text is not None:
                delta = job.stream.push(job.tokens)
                if delta:
                    job.on_text(delta)
            keep.append(i)
        if not keep:
            self._rows, self._cache, self._logits = [], None, None
            return
        if len(keep) < len(self._rows):
            index = torch.tensor(keep, device=chosen.device)
            self._cache.batch_select_indices(index)
            chosen, self._rows = chosen[index], [self._rows[i] for i in keep]
        self.peak_rows = max(self.peak_rows, len(self._rows))
        self.steps, self.row_steps = self.steps + 1, self.row_steps + len(self._rows)
        positions = torch.tensor([[job.position] for job in self._rows], device=chosen.device)
        with attach(self.model, FullCache()):
            out = self.model(input_ids=chosen[:, None], cache=self._cache, use_cache=True, position_ids=positions)
        self._logits = out.logits[:, -1].to(torch.float32)
        for job in self._rows:
            job.position += 1

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new jobs, finish the waiting and running ones, stop the thread; False if it did not stop."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
