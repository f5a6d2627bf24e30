"""The FastAPI application: its routes (OpenAI's chat and completion endpoints, models, health and metrics).

A request is read and validated (``schemas``), its prompt built (``chat_prompt``), its point decided
(``PointSource.decide``), then run by :class:`~kvsieve.serve.call.Call` (the scheduler, the answer or the stream).
What a reply reports about its cache is ``usage.py``; the body limit is ``body_limit.py``, the read timeouts
``reading.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvsieve.bundled import canonical_name
from kvsieve.prompt import Prompt
from kvsieve.serve.body_limit import BodyLimit, endpoint_of
from kvsieve.serve.call import Call
from kvsieve.serve.chat_prompt import chat_prompt, completion_prompt
from kvsieve.serve.errors import CLIENT_CLOSED_REQUEST, APIError, draining, error_body, quoted
from kvsieve.serve.reading import read_body
from kvsieve.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from kvsieve.serve.state import ServerState

__all__ = ["create_app"]

_log = logging.getLogger("uvicorn.error")  # uvicorn's own logger: shown at its --log-level, in its format


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name and (len(name) > 200 or canonical_name(name) != canonical_name(state.model_name)):
        raise APIError(400, f"model {quoted(name)} is not served here; this server serves {state.model_name!r}",
                       "model", "model_not_found")


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


def _prepare(state: ServerState, req, prompt: Prompt, kind: str, request: Request | None = None) -> Call:
    req.check_sampling()
    req.stops()
    n, m = prompt.context_ids.shape[1], prompt.question_ids.shape[1]
    param = "max_tokens"
    asked = req.max_tokens
    if kind == "chat" and req.max_completion_tokens is not None:
        param, asked = "max_completion_tokens", req.max_completion_tokens
    max_tokens = _max_tokens(state, asked, n + m, param)
    chosen = state.points.decide(req.kvsieve, prompt)
    return Call(state, kind, req, prompt, chosen, max_tokens, request)


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
        state.metrics.inc("kvsieve_requests_total", endpoint=endpoint_of(request.url.path), status=str(status),
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

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, _err: ClientDisconnect) -> Response:
        # the client's doing, not the server's: no 500, no traceback (the catch-all below re-raises to uvicorn)
        count(request, CLIENT_CLOSED_REQUEST)
        _log.info("%s %s: the client disconnected before its request body was read (counted as %d)",
                  request.method, request.url.path, CLIENT_CLOSED_REQUEST)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        count(request, 500)
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), status_code=500)

    async def serve(request: Request, kind: str) -> Response:
        if state.draining:
            raise draining()
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        raw = await read_body(request, state.read_timeout)
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
