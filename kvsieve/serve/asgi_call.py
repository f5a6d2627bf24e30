"""One HTTP request through an ASGI application in this process, its response streamed back as it is sent.

A server replica (``serve/replicas.py``) receives a request as plain values from the ingress that routed it and runs
it through its own FastAPI app (``create_app``), so every check, error and header is the single server's. The answer
comes back as it is written: first a :class:`Head` (status and headers), then the body's chunks (a stream's
server-sent events one by one). Closing the generator early, as Ray does when the client went away, tells the app the
client disconnected (the ``http.disconnect`` the app's requests poll for), so the scheduler drops the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = ["Head", "HttpRequest", "call"]

_running: set[asyncio.Task] = set()  # the apps' tasks, held until they end (asyncio keeps only weak references)


@dataclass(frozen=True)
class HttpRequest:
    """What the app needs of a request: its method, path (without the route prefix), query, headers and body."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]


def _scope(request: HttpRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "root_path": "", "query_string": request.query, "headers": list(request.headers), "client": None,
            "server": None, "state": {}}


def _retrieve(task: asyncio.Task) -> None:
    _running.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an app that failed after its answer was sent leaves no "never retrieved" log


async def call(app, request: HttpRequest, headers: list[tuple[bytes, bytes]] = ()) -> AsyncIterator[Head | bytes]:
    """Run ``request`` through ``app``; yield its :class:`Head` (with ``headers`` added), then its body's chunks."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    _running.add(task)
    task.add_done_callback(_retrieve)
    task.add_done_callback(lambda _: sent.put_nowait(None))
    started = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield Head(message["status"], [*message.get("headers", []), *headers])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
        if not started:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
            raise RuntimeError(f"the app ended without answering {request.method} {request.path}")
    finally:
        gone.set()  # a client that left before the body ended: the app sees http.disconnect
