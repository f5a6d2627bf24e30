"""Continuous batching by KV bytes with chunked prefill: one thread owns the model and runs it in steps.

**A step** is, in this order:

1. admission: waiting requests are admitted, first come first served, while the charges of the admitted ones plus
   the next one's fit the budget;
2. at most ``prefill_chunk`` prompt tokens of prefill, taken from the admitted requests still being prefilled, oldest
   first (:class:`~kvsieve.serve.generation.Prefill`: chunks read under the request's own ``kvsieve.attach``, the
   compression at its point once its context is read, then its question; a decode-time point's
   :class:`~kvsieve.serve.decode_prefill.DecodePrefill` evicts after each chunk as the grid did); a request whose
   prefill ends joins the running decode batch (``stack_caches``);
3. one decode step: every running row's next token, one batched forward of all of them under
   ``attach(model, FullCache())`` (nothing is compressed then; kvsieve's attention reads the ragged rows), each row at
   its own position. A finished or cancelled row leaves the batch (``batch_select_indices``) and its bytes return to
   the budget.

So a running stream waits at most one step between two tokens: one decode step plus one prefill chunk, whatever
arrives (a prefill that reads its whole prompt before the next decode step, as vLLM's first scheduler and this
server's earlier one did, stalls every stream for the longest prompt's prefill: seconds on a CPU). The chunk bounds
the gap and the decode step keeps every stream moving; a larger chunk prefills faster (fewer, larger matrix
products) at a longer gap. Exceptions: the compression at the end of a context runs whole (KVzip's reconstruction
repeats the context, about twice a prefill).

**What a request is charged** (exact bytes at the model's dtype; ``b`` is one token's KV bytes in every layer) is
what it can ever allocate, fixed at admission: ``b x (prompt tokens + max_tokens)`` (the prompt twice for a policy
that rebuilds the context, KVzip). Its prefill sets every segment's room itself (never the store's growth rule),
so once the prompt is read its cache allocates at most that: the compressed entries, the question and room for
``max_tokens`` (``cache_allocated_bytes``), and its charge drops to exactly what it allocates. Decoding appends in
place and allocates nothing more (a row leaves the batch at ``max_tokens``, before its room runs out); stacking
keeps each request's own layout. Every change of a charge is checked: the sum of charges never exceeds the budget,
and a request whose cache allocated more than its charge is failed, not admitted past it. Not charged: the brief
copies ``stack_caches`` and ``batch_select_indices`` make when the batch changes, and the dense copy a compression
makes of the layer it prunes.

A request arriving when the budget (counting those already waiting) cannot hold it waits, at most ``max_queue`` of
them; beyond that it is refused at once with a Retry-After (the app answers 429).

**The context cache** (``serve/contexts.py``, when the server keeps one): the compressed contexts it holds count in
the same budget, beside the charges (their sum never exceeds it), and are evicted whole, least recently used first,
when a request needs the room. A request whose context begins with a stored one is admitted for what it can allocate
on a copy of it: the stored context's bytes, the rest of its prompt, ``max_tokens`` and what its question recalls.
A query-agnostic request that read its context itself stores it when it joins the batch, if it fits beside the
charges.
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
from kvsieve.engine.cache import cache_allocated_bytes
from kvsieve.engine.generate import eos_ids
from kvsieve.policy import FullCache
from kvsieve.prompt import Prompt
from kvsieve.serve.contexts import ContextCache, StoredContext
from kvsieve.serve.decode_eviction import BudgetViolation, RowCap, evict_rows, hold_room, row_cap, stack_rows
from kvsieve.serve.decode_prefill import DecodePrefill, prefill_for
from kvsieve.serve.generation import CacheInfo, Cancelled, Completion, Prefill, bytes_per_token
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.server_metrics import Metrics
from kvsieve.serve.text_stream import IncrementalText, cut_at_stop

__all__ = ["DEFAULT_PREFILL_CHUNK", "Draining", "Job", "QueueFull", "TooLarge", "Scheduler"]

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens one step prefills at most


class QueueFull(Exception):
    def __init__(self, retry_after: int, message: str = "") -> None:
        super().__init__(message or f"the KV budget is full; retry after {retry_after} s")
        self.retry_after = retry_after


class TooLarge(Exception):
    """A request whose bytes alone exceed the whole budget: it could never be admitted."""


class Draining(Exception):
    """The server is shutting down and its drain timeout passed before this request finished."""


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
    arrived: float = field(default_factory=time.perf_counter)  # when the request arrived (TTFT counts from here)
    scope: str = ""  # which stored contexts it may reuse (serve/contexts.py)
    need: int = 0  # bytes it is admitted for: the most it can ever allocate (set by the scheduler)
    charge: int = 0  # bytes charged now
    started_at: float | None = None  # admitted
    # prefill and decoding state
    prefill: Prefill | DecodePrefill | None = None
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    info: CacheInfo | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    decode_started: float = 0.0
    stream: IncrementalText | None = None
    cap: RowCap | None = None  # a row that evicts while it decodes: its cap (serve/decode_eviction.py)
    fed: int = 0  # tokens its row took since its join or its last eviction

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """Admits jobs against ``budget`` bytes and runs them in steps of bounded prefill plus one decode step."""

    def __init__(self, model, tokenizer, budget: int, max_queue: int = 16, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 metrics: Metrics | None = None, contexts: ContextCache | None = None) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"the KV budget must be a positive number of bytes, got {budget!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
        self.model, self.tokenizer = model, tokenizer
        self.budget, self.max_queue, self.prefill_chunk = budget, max_queue, prefill_chunk
        self.metrics = metrics if metrics is not None else Metrics()
        self.contexts = contexts  # compressed contexts kept for later questions; None: every prompt is read whole
        self.token_bytes = bytes_per_token(model)
        self.eos = eos_ids(model, tokenizer)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._prefilling: list[Job] = []  # admitted, prompt not read yet, oldest first
        self._rows: list[Job] = []  # the running batch, in cache row order
        self._cache = None
        self._logits: torch.Tensor | None = None
        self.charged = 0  # bytes charged to admitted jobs now
        self.peak_charged = 0  # the most ever charged at once, stored contexts included (never above the budget)
        self.peak_rows = 0  # the most rows one decode step ran
        self.steps = self.row_steps = 0  # decode steps, and rows summed over them (mean rows in flight)
        self.prefill_seconds = self.decode_seconds = 0.0  # time spent in each part of the steps
        self.longest_step = 0.0  # the longest step (prefill chunk + decode step), seconds
        self.evictions = 0  # rows evicted back to their caps while decoding
        self.peak_allocated = 0  # the most KV bytes the batch and the prefills in progress allocated after a step
        self._seconds: collections.deque[float] = collections.deque(maxlen=50)  # recent service times
        self._accepting = True
        self._abort: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="kvsieve-serve-scheduler", daemon=True)
        self._thread.start()

    # -- what the app reads ---------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows) + len(self._prefilling)

    def retry_after(self) -> int:
        """Seconds until the budget likely has room: recent service time, shared by the running rows, times the
        requests ahead."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, math.ceil(mean * (len(self._waiting) + 1) / max(1, self.running)))

    def need_of(self, prompt: Prompt, chosen: ChosenPoint, max_tokens: int) -> tuple[int, int]:
        """(bytes a request is admitted for, of which its ``max_tokens``) (see the module docstring)."""
        tokens = prompt.context_ids.shape[1] + prompt.question_ids.shape[1]
        prefill_bytes = self.token_bytes * tokens
        if chosen.setting.compresses and chosen.point.policy.needs_reconstruction:
            prefill_bytes *= 2  # KVzip repeats the context over a copy of the cache
        reserve = self.token_bytes * max_tokens
        return prefill_bytes + reserve, reserve

    def need_on(self, context: StoredContext, prompt: Prompt, max_tokens: int) -> int:
        """Bytes a request is admitted for when its context begins with the stored ``context``: the copy's, and one
        entry a token for the rest of its prompt, ``max_tokens`` and what its question recalls."""
        rest = prompt.context_ids.shape[1] - context.length + prompt.question_ids.shape[1]
        return context.hot_bytes + self.token_bytes * (rest + max_tokens + context.recall_tokens)

    @property
    def stored_bytes(self) -> int:
        """The hot tiers of the stored contexts: charged to the budget beside the requests."""
        return 0 if self.contexts is None else self.contexts.hot_bytes

    def submit(self, job: Job) -> Job:
        job.need, reserve = self.need_of(job.prompt, job.chosen, job.max_tokens)
        if job.need > self.budget:
            raise TooLarge(f"this request needs {job.need} bytes of KV cache ({job.need - reserve} for its "
                           f"prompt, {reserve} for max_tokens={job.max_tokens}); the server's --kv-budget is "
                           f"{self.budget} bytes: shorten the prompt or max_tokens")
        with self._cond:
            if not self._accepting or self._abort is not None:
                raise Draining("the server is shutting down")
            ahead = self.charged + sum(j.need for j in self._waiting)
            if ahead + job.need > self.budget and len(self._waiting) >= self.max_queue:
                raise QueueFull(self.retry_after(), f"the KV budget is full ({self.charged} of {self.budget} bytes "
                                                    f"admitted, {len(self._waiting)} waiting)")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def abort(self, err: BaseException) -> None:
        """Fail every waiting and running job with ``err`` at the next step boundary, and every job submitted after
        (a drain that timed out: the server is going down)."""
        with self._cond:
            self._abort = err
            self._cond.notify_all()

    # -- charges ----------------------------------------------------------------------------------------
    def _set_charge(self, job: Job, charge: int) -> None:
        """Move ``job``'s charge to ``charge`` bytes; the invariant (sum of charges <= budget) is checked here."""
        with self._cond:
            total = self.charged - job.charge + charge
            if total + self.stored_bytes > self.budget:
                raise BudgetViolation(f"charging {charge} bytes would admit {total} of a {self.budget}-byte budget "
                                      f"beside {self.stored_bytes} bytes of stored contexts")
            self.charged, job.charge = total, charge
            self.peak_charged = max(self.peak_charged, self.charged + self.stored_bytes)
            self._cond.notify_all()

    def _release(self, job: Job) -> None:
        self._set_charge(job, 0)
        if job.started_at is not None:
            self._seconds.append(time.perf_counter() - job.started_at)

    def _fail(self, job: Job, err: BaseException) -> None:
        self._release(job)
        if not job.future.done():
            job.future.set_exception(err)

    # -- the model thread -------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Drop cancelled waiting jobs; admit waiting jobs, first come first served, while they fit (stored contexts
        evicted, least recently used first, to make the room; never the one a job reuses) and the prefills admitted
        already leave room in this step's chunk (admitting more would only hold their bytes idle)."""
        with self._cond:
            for job in [j for j in self._waiting if j.cancelled.is_set()]:
                self._waiting.remove(job)
                job.future.set_exception(Cancelled())
            while (self._waiting and self.charged + self._waiting[0].need <= self.budget
                   and sum(j.prefill.remaining for j in self._prefilling) < self.prefill_chunk):
                job = self._waiting[0]
                context = self._stored_context(job)
                need = job.need if context is None else self.need_on(context, job.prompt, job.max_tokens)
                if context is not None and need + context.hot_bytes > self.budget:  # copy and original never fit
                    context, need = None, job.need
                if self.contexts is not None and not self.contexts.make_room(self.budget - self.charged - need,
                                                                             keep=context):
                    break  # the stored context it reuses and the running requests leave no room yet
                self._waiting.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                if self._may_store(job.chosen):
                    self.contexts.used(context)
                job.need = need
                self._set_charge(job, job.need)
                job.started_at = time.perf_counter()
                scope = job.scope if self._may_store(job.chosen) else None
                job.prefill = prefill_for(self.model, job.prompt, job.chosen, job.max_tokens, context, scope)
                self._prefilling.append(job)

    def _may_store(self, chosen: ChosenPoint) -> bool:
        """Whether a request at ``chosen`` reuses and stores contexts, with a context cache: a query-agnostic prefill
        point's (a question-aware one compresses with its question; a decode-time one reads its prompt under
        eviction, which a stored context would skip)."""
        setting = chosen.setting
        return (self.contexts is not None and not setting.protects_question
                and not (setting.mode.is_decode and setting.compresses))

    def _stored_context(self, job: Job) -> StoredContext | None:
        if not self._may_store(job.chosen):
            return None
        return self.contexts.match(job.scope, str(job.chosen.setting), job.prompt.context_ids)

    def _idle(self) -> bool:
        """Wait while there is nothing to do; False once the scheduler is closed and empty."""
        with self._cond:
            while not (self._rows or self._prefilling
                       or (self._abort is not None and self._waiting)
                       or (self._waiting and self.charged + self._waiting[0].need <= self.budget)
                       or any(j.cancelled.is_set() for j in self._waiting)):
                if not self._accepting and not self._waiting:
                    return False
                self._cond.wait(0.5)
            return True

    def _work(self) -> None:
        while self._idle():
            if self._abort is not None:
                self._drop_all(self._abort)
                continue
            start = time.perf_counter()
            self._admit()
            self._prefill_chunk()
            middle = time.perf_counter()
            if self._rows:
                try:
                    self._step()
                except BaseException as err:  # noqa: BLE001 - a failed batched forward fails its rows, not the server
                    rows, self._rows, self._cache, self._logits = self._rows, [], None, None
                    for row in rows:
                        self._fail(row, err)
            end = time.perf_counter()
            self._measure()
            self.prefill_seconds += middle - start
            self.decode_seconds += end - middle
            self.longest_step = max(self.longest_step, end - start)

    def _measure(self) -> None:
        """The KV bytes allocated now (the decode batch and every prefill in progress), for ``peak_allocated``."""
        allocated = 0 if self._cache is None else cache_allocated_bytes(self._cache)
        allocated += sum(cache_allocated_bytes(j.prefill.cache) for j in self._prefilling
                         if j.prefill is not None and j.prefill.cache is not None)
        self.peak_allocated = max(self.peak_allocated, allocated)

    def _drop_all(self, err: BaseException) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting + self._prefilling + self._rows:
            self._fail(job, err)
        self._prefilling, self._rows, self._cache, self._logits = [], [], None, None

    def _prefill_chunk(self) -> None:
        """At most ``prefill_chunk`` prompt tokens, oldest admitted request first; finished prefills join the batch."""
        for job in [j for j in self._prefilling if j.cancelled.is_set()]:
            self._prefilling.remove(job)
            self._fail(job, Cancelled())
        left = self.prefill_chunk
        for job in list(self._prefilling):
            if left <= 0:
                break
            try:
                left -= job.prefill.advance(left)
                if job.prefill.done:
                    self._prefilling.remove(job)
                    self._join(job)
            except BaseException as err:  # noqa: BLE001 - the request's failure, never the scheduler's
                if job in self._prefilling:
                    self._prefilling.remove(job)
                self._fail(job, err)

    def _join(self, job: Job) -> None:
        """A prefilled job into the batch, charged what it can ever allocate from now on (at most its admission):
        exactly what its cache allocates, or its cap when it evicts while it decodes."""
        prefill, (cache, logits, info) = job.prefill, job.prefill.finished()
        job.prefill = None
        if prefill.evicts_while_decoding:
            job.cap = row_cap(cache, info.chosen.point.policy, prefill.room)
            if job.cap.charge > job.need:  # a prompt shorter than the policy's protected entries: grow instead
                job.cap = None
                hold_room(cache, job.max_tokens)
        allocated = cache_allocated_bytes(cache)
        if allocated > job.need:
            raise BudgetViolation(f"the request's cache allocated {allocated} bytes, more than the {job.need} it was "
                                  "admitted for")
        self._set_charge(job, allocated if job.cap is None else job.cap.charge)
        if prefill.to_store is not None:  # beside the charges, in the room they leave
            self.contexts.put(prefill.to_store, self.budget - self.charged)
        job.info = info
        job.position = info.prompt_tokens
        job.stream = IncrementalText(self.tokenizer, job.stops)
        if job.on_prefilled is not None:
            job.on_prefilled(info)
        job.decode_started = time.perf_counter()
        # query statistics and hidden states are dropped; the last queries and remembered scores stay (evictions)
        self._cache = stack_rows(self._cache, cache)
        logits = logits[None].to(torch.float32)
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._rows.append(job)

    def _finish(self, job: Job, stopped: bool) -> None:
        self._release(job)
        text, cut = cut_at_stop(self.tokenizer.decode(job.tokens, skip_special_tokens=True), job.stops)
        if job.on_text is not None:
            rest = job.stream.finish(text)
            if rest:
                job.on_text(rest)
        finish = "stop" if stopped or cut or len(job.tokens) < job.max_tokens else "length"
        first = None if job.first_token_at is None else job.first_token_at - job.arrived
        job.future.set_result(Completion(text, job.tokens, finish, job.info, time.perf_counter() - job.decode_started,
                                         first, job.gaps))

    def _token(self, job: Job, token: int) -> None:
        now = time.perf_counter()
        job.tokens.append(token)
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.observe("kvsieve_time_to_first_token_seconds", now - job.arrived)
        else:
            job.gaps.append(now - job.last_token_at)
            self.metrics.observe("kvsieve_inter_token_seconds", now - job.last_token_at)
        job.last_token_at = now

    @torch.no_grad()
    def _step(self) -> None:
        """Pick every row's next token; drop finished rows; one batched forward of the rest."""
        chosen = self._logits.argmax(dim=-1)
        keep: list[int] = []
        for i, job in enumerate(self._rows):
            if job.cancelled.is_set():
                self._fail(job, Cancelled())
                continue
            token = int(chosen[i])
            if token in self.eos:
                self._finish(job, stopped=True)
                continue
            self._token(job, token)
            delta = job.stream.add(token)  # the token decoded once, in its short window; what it made visible
            if job.on_text is not None and delta:  # is sent before a finish (the stream marks it sent)
                job.on_text(delta)
            if job.stream.stopped:
                self._finish(job, stopped=True)
                continue
            if len(job.tokens) >= job.max_tokens:
                self._finish(job, stopped=False)
                continue
            keep.append(i)
        if not keep:
            self._rows, self._cache, self._logits = [], None, None
            return
        if len(keep) < len(self._rows):
            index = torch.tensor(keep, device=chosen.device)
            self._cache.batch_select_indices(index)
            chosen, self._rows = chosen[index], [self._rows[i] for i in keep]
        order = self._evict()
        if order is not None:  # the batch was rebuilt: rows in a new order, those whose eviction failed gone
            if not order:
                self._rows, self._cache, self._logits = [], None, None
                return
            chosen = chosen[torch.tensor(order, device=chosen.device)]
        self.peak_rows = max(self.peak_rows, len(self._rows))
        self.steps, self.row_steps = self.steps + 1, self.row_steps + len(self._rows)
        positions = torch.tensor([[job.position] for job in self._rows], device=chosen.device)
        with attach(self.model, FullCache()):
            out = self.model(input_ids=chosen[:, None], cache=self._cache, use_cache=True, position_ids=positions)
        self._logits = out.logits[:, -1].to(torch.float32)
        for job in self._rows:
            job.position += 1
            job.fed += 1
        allocated = cache_allocated_bytes(self._cache)
        if allocated > sum(job.charge for job in self._rows):  # a segment outgrew its room: never expected
            raise BudgetViolation(f"the decode batch allocates {allocated} bytes, more than its rows are charged")

    def _evict(self) -> list[int] | None:
        """The rows whose room is used up (``room`` tokens since their join or their last eviction) evicted back to
        their caps, before the step that would take one more, in one rebuild of the batch
        (``serve/decode_eviction.py``). Each row on its own count, so what a row keeps never depends on what else
        runs. Returns the rows' new order (old indices: those left as they were, then the evicted ones; a row whose
        eviction failed is failed and gone, it has no room left), or None when no row was due."""
        due = [job.cap is not None and job.fed >= job.cap.room for job in self._rows]
        if not any(due):
            return None
        rows = [(job.info.chosen.point.policy, job.cap) if d else None for job, d in zip(self._rows, due)]
        self._cache, order, failed = evict_rows(self._cache, rows, [job.position for job in self._rows],
                                                [job.fed for job in self._rows])
        for i, err in failed.items():
            setting = self._rows[i].info.chosen.setting
            self._fail(self._rows[i], RuntimeError(f"policy {setting} failed while evicting during decoding "
                                                   f"({type(err).__name__}: {err})"))
        for job, d in zip(self._rows, due):
            if d:
                job.fed = 0
        self._rows = [self._rows[i] for i in order]
        self.evictions += sum(due)
        return order

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new jobs, finish the waiting and running ones, stop the thread; False if it did not stop."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
