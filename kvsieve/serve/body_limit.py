"""The body limit (ASGI middleware): a request body over ``--max-body-mb`` is refused with 413 before it is read."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvsieve.serve.errors import error_body

__all__ = ["BodyLimit", "endpoint_of"]


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
        self.metrics.inc("kvsieve_requests_total", endpoint=endpoint_of(scope["path"]), status="413", kv_cache="none")
        body = error_body(f"the request body is {size}; this server accepts at most {self.limit} (--max-body-mb)",
                          "invalid_request_error", None, "body_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def endpoint_of(path: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path, "other")
