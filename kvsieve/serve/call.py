"""One request's life once its point is decided: submitted to the scheduler, its events from the model thread
(prefilled, text, done) on an asyncio queue, answered whole or streamed as server-sent events, its metrics recorded,
and its job cancelled when its client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvsieve.prompt import Prompt
from kvsieve.serve.contexts import scope_of
from kvsieve.serve.errors import APIError, draining
from kvsieve.serve.generation import Cancelled, Completion
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.scheduler import Draining, Job, QueueFull, TooLarge
from kvsieve.serve.state import ServerState
from kvsieve.serve.usage import kv_cache_usage, kv_headers

__all__ = ["Call"]


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class Call:
    """One request through the queue: events from the worker thread arrive on an asyncio queue."""

    def __init__(self, state: ServerState, kind: str, req, prompt: Prompt, chosen: ChosenPoint, max_tokens: int,
                 request: Request | None = None):
        self.state, self.kind, self.req, self.prompt, self.chosen = state, kind, req, prompt, chosen
        self.request = request  # to notice a client that leaves before a non-streamed answer is ready
        self.max_tokens, self.stops = max_tokens, req.stops()
        self.arrived = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.first_text_at: float | None = None
        self.job = None

    def _put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def submit(self) -> None:
        state = self.state
        job = Job(self.prompt, self.chosen, self.max_tokens, self.stops,
                  on_prefilled=lambda i: self._put(("prefilled", i)),
                  on_text=(lambda d: self._put(("text", d))) if self.req.stream else None, arrived=self.arrived,
                  scope=scope_of(state.context_scope, None if self.request is None
                                 else self.request.headers.get("authorization")))
        try:
            self.job = state.scheduler.submit(job)
        except TooLarge as big:
            raise APIError(400, str(big), "max_tokens", "kv_budget_exceeded") from big
        except Draining as err:
            raise draining(str(err)) from err
        except QueueFull as full:
            raise APIError(429, f"{full}; retry after {full.retry_after} s", code="kv_budget_full",
                           kind="rate_limit_error", headers={"Retry-After": str(full.retry_after)}) from full
        self.job.future.add_done_callback(lambda f: self._put(("done", f)))

    def failure(self, err: BaseException) -> APIError:
        if isinstance(err, APIError):
            return err
        if isinstance(err, Cancelled):
            return APIError(499, "the request was cancelled", code="cancelled")
        if isinstance(err, Draining):
            return draining(str(err))
        return APIError(500, f"the request failed while generating: {type(err).__name__}: {err}",
                        code="generation_failed")

    def record(self, status: int, completion: Completion | None) -> None:
        m = self.state.metrics
        ran = completion.cache.chosen if completion is not None and completion.cache.chosen else self.chosen
        m.inc("kvsieve_requests_total", endpoint=self.kind, status=str(status), kv_cache=ran.status)
        # by the point's spec and mode, the server's own labels (with a client's ratio they would be unbounded)
        m.inc("kvsieve_point_requests_total", point=ran.setting.stored, kv_cache=ran.status)
        m.observe("kvsieve_request_seconds", time.perf_counter() - self.arrived)
        if completion is None:
            return
        if ran.status == "fallback" and ran is not self.chosen:
            m.inc("kvsieve_policy_failures_total")
        info = completion.cache
        m.inc("kvsieve_prompt_tokens_total", info.prompt_tokens)
        m.inc("kvsieve_completion_tokens_total", len(completion.token_ids))
        m.inc("kvsieve_kv_bytes_full_total", info.bytes_full)
        m.inc("kvsieve_kv_bytes_kept_total", info.bytes_kept)
        m.inc("kvsieve_kv_bytes_saved_total", info.bytes_full - info.bytes_kept)
        m.inc("kvsieve_kv_bytes_cold_total", info.cold_bytes)
        m.inc("kvsieve_kv_bytes_moved_total", info.moved_bytes)
        if self.job is not None and self.job.started_at:  # time to first token and between tokens: the scheduler's
            m.observe("kvsieve_queue_seconds", max(0.0, self.job.started_at - self.arrived))

    def usage(self, completion: Completion) -> dict:
        info = completion.cache
        return {"prompt_tokens": info.prompt_tokens, "completion_tokens": len(completion.token_ids),
                "total_tokens": info.prompt_tokens + len(completion.token_ids),
                "kv_cache": kv_cache_usage(self.state, self.chosen, info)}

    def body(self, completion: Completion) -> dict:
        base = {"id": self.id, "created": self.created, "model": self.state.model_name,
                "usage": self.usage(completion)}
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                      "finish_reason": completion.finish_reason, "logprobs": None}
            return dict(base, object="chat.completion", choices=[choice])
        choice = {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}
        return dict(base, object="text_completion", choices=[choice])

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": [choice]}

    async def until(self, *kinds: str):
        while True:
            kind, value = await self.events.get()
            if kind in kinds:
                return kind, value

    async def _event_or_gone(self, *kinds: str):
        """The first event of ``kinds`` (kind, value), or None when the client disconnected first (checked twice a
        second: nothing else tells an endpoint that has not started its answer that its client left); a client that
        left, or a cancelled endpoint, stops the request's decoding (:meth:`_gone`)."""
        waiter = asyncio.ensure_future(self.until(*kinds))
        try:
            while True:
                finished, _ = await asyncio.wait({waiter}, timeout=0.5)
                if finished:
                    return waiter.result()
                if self.request is not None and await self.request.is_disconnected():
                    self._gone()
                    return None
        except asyncio.CancelledError:
            self._gone()
            raise
        finally:
            waiter.cancel()

    def _gone(self) -> None:
        """The client went away: stop its decoding; its bytes return to the budget."""
        self.job.cancel()
        self.state.metrics.inc("kvsieve_requests_total", endpoint=self.kind, status="499", kv_cache=self.chosen.status)

    def _raise_recorded(self, failure: APIError) -> None:
        """Count ``failure`` in the metrics once, then answer with it."""
        self.record(failure.status, None)
        failure.recorded = True
        raise failure

    async def answer(self) -> Response:
        event = await self._event_or_gone("done")
        if event is None:
            return Response(status_code=499)
        future = event[1]
        err = future.exception()
        if err is not None:
            self._raise_recorded(self.failure(err))
        completion = future.result()
        body = self.body(completion)
        self.record(200, completion)
        return JSONResponse(body, headers=kv_headers(body["usage"]["kv_cache"]))

    async def stream(self) -> Response:
        # a client that leaves while its request waits or is prefilled is noticed here (no stream yet)
        event = await self._event_or_gone("prefilled", "done")
        if event is None:
            return Response(status_code=499)
        kind, value = event
        if kind == "done":  # failed (or finished) before the first event: a plain error answer
            err = value.exception()
            self._raise_recorded(self.failure(err) if err is not None
                                 else APIError(500, "the request ended before its prefill"))
        kv = kv_cache_usage(self.state, self.chosen, value)
        return StreamingResponse(self._events(), media_type="text/event-stream", headers=kv_headers(kv))

    async def _events(self) -> AsyncIterator[bytes]:
        finished = False
        try:
            if self.kind == "chat":
                yield _sse(self.chunk(None, role=True))
            while True:
                kind, value = await self.events.get()
                if kind == "text":
                    yield _sse(self.chunk(value))
                elif kind == "done":
                    finished = True
                    err = value.exception()
                    if err is not None:
                        failure = self.failure(err)
                        self.record(failure.status, None)
                        yield _sse(failure.body())
                        return
                    completion = value.result()
                    last = self.chunk(None if self.kind == "chat" else "", completion.finish_reason)
                    last["usage"] = self.usage(completion)
                    yield _sse(last)
                    opts = self.req.stream_options
                    if opts is not None and opts.include_usage:  # OpenAI's separate usage chunk
                        usage = dict(self.chunk(None), choices=[], usage=last["usage"])
                        yield _sse(usage)
                    yield _sse("[DONE]")
                    self.record(200, completion)
                    return
        finally:
            if not finished:  # the client went away mid-stream
                self._gone()
