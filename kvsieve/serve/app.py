"""The FastAPI application: OpenAI's chat and completion endpoints, models, health and metrics.

Every answer carries ``usage.kv_cache`` (and ``x-kvsieve-*`` headers): the policy and ratio it ran, whether
that point is the contract's certified one, a fallback to full KV (and why), or the client's choice, the
cache bytes the prompt would have held and held, and the tokens kept per layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsieve.bundled import canonical_name
from kvsieve.prompt import Prompt
from kvsieve.risk.runtime import OperatingPoint
from kvsieve.serve.chat_prompt import chat_prompt, completion_prompt
from kvsieve.serve.errors import APIError, error_body, quoted
from kvsieve.serve.generation import CacheInfo, Cancelled, Completion
from kvsieve.serve.points import ChosenPoint
from kvsieve.serve.scheduler import Draining, Job, QueueFull, TooLarge
from kvsieve.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from kvsieve.serve.state import ServerState

__all__ = ["create_app", "draining", "kv_cache_usage"]


def _feasible(chosen: ChosenPoint, prompt: Prompt) -> ChosenPoint:
    """Full KV, with the reason, when the prompt is too short for the point's policy to compress it."""
    if not chosen.compresses:
        return chosen
    point = chosen.point
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    first = n + m if point.question_aware else n
    policy = point.policy
    reason = ""
    if policy.uses_window and first < policy.window:
        reason = (f"the prompt's compressed part ({first} tokens) is shorter than {point.policy_spec}'s window "
                  f"({policy.window})")
    elif n < 2:
        reason = f"the context ({n} tokens) is too short to compress"
    if not reason:
        return chosen
    return ChosenPoint(OperatingPoint.full(point.bucket, reason), "fallback")


def kv_cache_usage(state: ServerState, chosen: ChosenPoint, info: CacheInfo) -> dict:
    chosen = info.chosen or chosen  # the point that ran: full KV when the request's policy failed
    point = chosen.point
    contract = state.points.certified.contract.contract if state.points.certified else None
    return {
        "policy": point.policy_spec,  # the full cache's spec when it fell back
        "ratio": point.ratio if not point.fell_back else 0.0,
        "question_aware": bool(point.question_aware and not point.fell_back),
        "status": chosen.status,
        "certified": chosen.certified,
        "bucket": point.bucket,
        "reason": point.reason,
        "contract": None if contract is None else {"alpha": contract.alpha, "delta": contract.delta,
                                                   "epsilon": contract.epsilon, "loss": contract.loss},
        "context_tokens": info.context_tokens,
        "bytes_full": info.bytes_full,
        "bytes_kept": info.bytes_kept,
        "bytes_saved": info.bytes_full - info.bytes_kept,
        "kept_fraction": round(info.bytes_kept / max(1, info.bytes_full), 6),
        "kept_tokens_per_layer": info.kept_tokens,
    }


def _header(value: object, limit: int = 256) -> str:
    """A header value: printable ASCII only (a CR, LF or NUL would end the header or the connection; non-ASCII is
    not latin-1 safe), cut to ``limit``. Every value here is the server's own (bucket names come from the contract,
    never the client's text); this is the second line of defence."""
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value)[:limit])
    return text


def _headers(kv: dict) -> dict[str, str]:
    return {"x-kvsieve-policy": _header(kv["policy"]), "x-kvsieve-ratio": f"{kv['ratio']:g}",
            "x-kvsieve-status": kv["status"], "x-kvsieve-bucket": _header(kv["bucket"]),
            "x-kvsieve-bytes-full": str(kv["bytes_full"]),
            "x-kvsieve-bytes-kept": str(kv["bytes_kept"]),
            "x-kvsieve-kept-tokens": ",".join(str(t) for t in kv["kept_tokens_per_layer"])}


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class _Call:
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
                  on_text=(lambda d: self._put(("text", d))) if self.req.stream else None, arrived=self.arrived)
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
        second: nothing else tells an endpoint that has not started its answer that its client left)."""
        waiter = asyncio.ensure_future(self.until(*kinds))
        try:
            while True:
                finished, _ = await asyncio.wait({waiter}, timeout=0.5)
                if finished:
                    return waiter.result()
                if self.request is not None and await self.request.is_disconnected():
                    return None
        finally:
            waiter.cancel()

    def _gone(self) -> None:
        """The client went away: stop its decoding; its bytes return to the budget."""
        self.job.cancel()
        self.state.metrics.inc("kvsieve_requests_total", endpoint=self.kind, status="499", kv_cache=self.chosen.status)

    async def answer(self) -> Response:
        try:
            event = await self._event_or_gone("done")
        except asyncio.CancelledError:
            self._gone()
            raise
        if event is None:
            self._gone()
            return Response(status_code=499)
        future = event[1]
        err = future.exception()
        if err is not None:
            failure = self.failure(err)
            self.record(failure.status, None)
            failure.recorded = True
            raise failure
        completion = future.result()
        body = self.body(completion)
        self.record(200, completion)
        return JSONResponse(body, headers=_headers(body["usage"]["kv_cache"]))

    async def stream(self) -> Response:
        try:  # a client that leaves while its request waits or is prefilled is noticed here (no stream yet)
            event = await self._event_or_gone("prefilled", "done")
        except asyncio.CancelledError:
            self._gone()
            raise
        if event is None:
            self._gone()
            return Response(status_code=499)
        kind, value = event
        if kind == "done":  # failed (or finished) before the first event: a plain error answer
            err = value.exception()
            failure = self.failure(err) if err is not None else APIError(500, "the request ended before its prefill")
            self.record(failure.status, None)
            failure.recorded = True
            raise failure
        kv = kv_cache_usage(self.state, self.chosen, value)
        return StreamingResponse(self._events(), media_type="text/event-stream", headers=_headers(kv))

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


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name and (len(name) > 200 or canonical_name(name) != canonical_name(state.model_name)):
        raise APIError(400, f"model {quoted(name)} is not served here; this server serves {state.model_name!r}",
                       "model", "model_not_found")


DRAIN_RETRY_AFTER = 10  # seconds a client refused while the server shuts down is told to wait


def draining(message: str = "the server is shutting down") -> APIError:
    return APIError(503, f"{message}; retry after {DRAIN_RETRY_AFTER} s", code="draining", kind="server_error",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER)})


def _max_tokens(state: ServerState, asked: int | None, prompt_tokens: int, param: str) -> int:
    room = state.context_length - prompt_tokens
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens; the model's context is {state.context_length} "
                            "tokens, which leaves no room to generate", "messages", "context_length_exceeded")
    limit = min(room, state.max_tokens_limit)
    if asked is None:
        return min(state.default_max_tokens, limit)
    if not 1 <= asked <= limit:
        why = (f"the model's context ({state.context_length}) minus the prompt ({prompt_tokens})" if room <= limit
               else f"the server's --max-tokens-limit ({state.max_tokens_limit})")
        raise APIError(400, f"{param} {asked} is out of range: allowed 1..{limit} ({why})", param, "invalid_value")
    return asked


def _prepare(state: ServerState, req, prompt: Prompt, kind: str, request: Request | None = None) -> _Call:
    req.check_sampling()
    req.stops()
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    param = "max_tokens"
    asked = req.max_tokens
    if kind == "chat" and req.max_completion_tokens is not None:
        param, asked = "max_completion_tokens", req.max_completion_tokens
    max_tokens = _max_tokens(state, asked, n + m, param)
    chosen = _feasible(state.points.choose(req.kvsieve, n), prompt)
    return _Call(state, kind, req, prompt, chosen, max_tokens, request)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, before it is read whole: a declared length at once,
    a chunked body as soon as it passes the limit. (FastAPI's ``max_body_size`` answers a plain "Content Too
    Large" that replaces any other answer; this one names the limit and the flag, as every error here does.)"""

    def __init__(self, app, limit: int, metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, f"{int(declared)} bytes")
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send, f"over {self.limit} bytes")

    async def _refuse(self, scope, receive, send, size: str) -> None:
        self.metrics.inc("kvsieve_requests_total", endpoint=_endpoint(scope["path"]), status="413", kv_cache="none")
        body = error_body(f"the request body is {size}; this server accepts at most {self.limit} (--max-body-mb)",
                          "invalid_request_error", None, "body_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _endpoint(path: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path, "other")


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        state.draining = True  # uvicorn has finished the in-flight requests by now
        await asyncio.to_thread(state.scheduler.close, 60.0)

    app = FastAPI(title="kvsieve serve", lifespan=lifespan)
    app.state.kvsieve = state
    app.add_middleware(BodyLimit, limit=state.max_body_bytes, metrics=state.metrics)

    def count(request: Request, status: int) -> None:
        state.metrics.inc("kvsieve_requests_total", endpoint=_endpoint(request.url.path), status=str(status),
                          kv_cache="none")

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        if not getattr(err, "recorded", False):
            count(request, err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        count(request, err.status_code)
        return JSONResponse(error_body(str(err.detail), "invalid_request_error"), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        count(request, 500)
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), status_code=500)

    async def serve(request: Request, kind: str) -> Response:
        if state.draining:
            raise draining()
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        raw = await request.body()
        # parsing and tokenizing a large body take time: off the event loop, so /health and streams go on
        req = await run_in_threadpool(parse_body, raw, schema)
        _check_model(state, req.model)
        if kind == "chat":
            if req.logprobs:
                raise APIError(400, "logprobs is not supported (omit it or pass false)", "logprobs")
            prompt = await run_in_threadpool(chat_prompt, state.tokenizer, req.messages)
        else:
            if req.echo or req.logprobs:
                name = "echo" if req.echo else "logprobs"
                raise APIError(400, f"{name} is not supported for completions (omit it)", name)
            prompt = await run_in_threadpool(completion_prompt, state.tokenizer, req.text())
        call = _prepare(state, req, prompt, kind, request)
        call.submit()
        return await (call.stream() if req.stream else call.answer())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "kvsieve"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        scheduler = state.scheduler
        body = {"status": "draining" if state.draining else "ok", "model": state.model_name,
                "points": state.points.kind, "waiting": scheduler.waiting, "running": scheduler.running,
                "kv_budget_bytes": scheduler.budget, "kv_admitted_bytes": scheduler.charged}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        scheduler, gauges = state.scheduler, state.metrics.gauges
        gauges["kvsieve_queue_waiting"] = scheduler.waiting
        gauges["kvsieve_requests_running"] = scheduler.running
        gauges["kvsieve_kv_budget_bytes"] = scheduler.budget
        gauges["kvsieve_kv_admitted_bytes"] = scheduler.charged
        gauges["kvsieve_kv_admitted_peak_bytes"] = scheduler.peak_charged
        gauges["kvsieve_kv_allocated_peak_bytes"] = scheduler.peak_allocated
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
